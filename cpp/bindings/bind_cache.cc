// Python access to the node-wide file cache; a Python callable may fetch remote sources.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <unistd.h>

#include <memory>

#include "fanrun/file_cache.h"
#include "fanrun/http_fetch.h"
#include "fanrun/prefetch_local.h"
#include "status_to_python.h"

namespace nb = nanobind;

namespace fanrun::bindings {
namespace {

// Owns the engine cache and the Python fetch callable. The cache's threads call the
// callable with the GIL taken only around the call; they are joined with the GIL
// released, or a thread waiting for the GIL would never finish.
class PyFileCache {
 public:
  PyFileCache(const std::string& dir, uint64_t limit_bytes, int threads, int attempts, nb::object fetch, bool native_http)
      : fetch_(std::move(fetch)), owner_pid_(::getpid()) {
    CacheOptions options;
    options.dir = dir;
    options.limit_bytes = limit_bytes;
    options.threads = threads;
    options.attempts = attempts;
    Fetcher fetcher = CopyLocalFile;
    if (!fetch_.is_none()) {
      PyObject* callable = fetch_.ptr();  // kept alive by fetch_ for as long as the threads run
      // http:// sources are fetched by the engine itself, without the GIL; what it leaves
      // (https, redirects, chunked bodies) and every other source goes to the callable.
      std::shared_ptr<HttpFetcher> http = native_http ? std::make_shared<HttpFetcher>() : nullptr;
      fetcher = [callable, http](const CacheItem& item, const std::string& partial) -> Status {
        if (http != nullptr) {
          bool fall_back = false;
          Status fetched = http->Fetch(item, partial, &fall_back);
          if (!fall_back) return fetched;
        }
        if (!nb::is_alive()) return Status::Invalid("The interpreter is shutting down");
        nb::gil_scoped_acquire gil;
        try {
          nb::handle function(callable);
          function(item.source, partial);
          return Status::OK();
        } catch (nb::python_error& error) {
          // The exception's type and text, not its traceback: the message names the source.
          std::string text = nb::cast<std::string>(nb::str(error.type().attr("__name__"))) + ": " +
                             nb::cast<std::string>(nb::str(error.value()));
          return Status(StatusCode::kIOError, text);
        }
      };
    }
    Result<std::unique_ptr<FileCache>> opened = FileCache::Open(options, std::move(fetcher));
    ThrowIfError(opened.status());
    cache_ = std::move(opened).ValueOrDie();
  }

  ~PyFileCache() { Close(); }

  void Close() {
    if (cache_ == nullptr) return;
    if (::getpid() != owner_pid_) {
      // A forked child (a DataLoader worker) holds a copy without the threads: joining
      // them here would touch threads of another process. Its memory is let go unfreed.
      (void)cache_.release();
      return;
    }
    nb::gil_scoped_release release;
    cache_.reset();
  }

  FileCache& cache() {
    if (cache_ == nullptr) ThrowIfError(Status::Invalid("The file cache is closed"));
    if (::getpid() != owner_pid_) {
      ThrowIfError(Status::Invalid("This file cache was opened by process ", owner_pid_,
                                   "; a forked process must open its own"));
    }
    return *cache_;
  }

 private:
  nb::object fetch_;
  const pid_t owner_pid_;
  std::unique_ptr<FileCache> cache_;
};

// The local prefetcher, refusing use from a forked copy whose threads did not come along.
class PyLocalPrefetcher {
 public:
  explicit PyLocalPrefetcher(int threads)
      : owner_pid_(::getpid()), prefetcher_(std::make_unique<LocalPrefetcher>(threads)) {}
  ~PyLocalPrefetcher() {
    if (::getpid() != owner_pid_) {
      (void)prefetcher_.release();  // see PyFileCache::Close
      return;
    }
    nb::gil_scoped_release release;
    prefetcher_.reset();
  }

  LocalPrefetcher& prefetcher() {
    if (::getpid() != owner_pid_) {
      ThrowIfError(Status::Invalid("This prefetcher was made by process ", owner_pid_, "; a forked process must make its own"));
    }
    return *prefetcher_;
  }

 private:
  const pid_t owner_pid_;
  std::unique_ptr<LocalPrefetcher> prefetcher_;
};

}  // namespace

void BindCache(nb::module_& m) {
  nb::class_<PyLocalPrefetcher>(m, "LocalPrefetcher")
      .def(nb::init<int>(), nb::arg("threads"))
      .def_ro_static("READ_THROUGH_BYTES", &LocalPrefetcher::kReadThroughBytes)
      .def("hint", [](PyLocalPrefetcher& self, std::vector<std::string> paths) { self.prefetcher().Hint(std::move(paths)); },
           nb::arg("paths"))
      .def("drain",
           [](PyLocalPrefetcher& self) {
             LocalPrefetcher& prefetcher = self.prefetcher();
             nb::gil_scoped_release release;
             prefetcher.Drain();
           })
      .def(
          "wait",
          [](PyLocalPrefetcher& self, const std::string& path) {
            LocalPrefetcher& prefetcher = self.prefetcher();
            nb::gil_scoped_release release;
            prefetcher.Wait(path);
          },
          nb::arg("path"))
      .def("stats", [](PyLocalPrefetcher& self) {
        const LocalPrefetcher::Counts counts = self.prefetcher().counts();
        nb::dict out;
        out["hinted"] = counts.hinted;
        out["resident"] = counts.resident;
        out["skipped"] = counts.skipped;
        out["failed"] = counts.failed;
        return out;
      });
  nb::class_<PyFileCache>(m, "FileCache", nb::is_weak_referenceable())
      .def(nb::init<const std::string&, uint64_t, int, int, nb::object, bool>(), nb::arg("dir"), nb::arg("limit_bytes"),
           nb::arg("threads"), nb::arg("attempts"), nb::arg("fetch").none(), nb::arg("native_http") = false)
      .def(
          "prefetch",
          [](PyFileCache& self, const std::string& source, const std::string& name, int64_t size) {
            ThrowIfError(self.cache().Prefetch(CacheItem{source, name, size}));
          },
          nb::arg("source"), nb::arg("name"), nb::arg("size"))
      .def(
          "acquire",
          [](PyFileCache& self, const std::string& source, const std::string& name, int64_t size) {
            FileCache& cache = self.cache();
            Result<std::string> path = Status::Internal("not acquired");
            {
              nb::gil_scoped_release release;
              path = cache.Acquire(CacheItem{source, name, size});
            }
            return ValueOrThrow(std::move(path));
          },
          nb::arg("source"), nb::arg("name"), nb::arg("size"))
      .def("release", [](PyFileCache& self, const std::string& name) { self.cache().Release(name); }, nb::arg("name"))
      .def("release_all", [](PyFileCache& self) { self.cache().ReleaseAll(); })
      .def("stats",
           [](PyFileCache& self) {
             CacheStats stats = self.cache().Stats();
             nb::dict out;
             out["hits"] = stats.hits;
             out["fetched"] = stats.fetched;
             out["bytes_fetched"] = stats.bytes_fetched;
             out["retries"] = stats.retries;
             out["evicted"] = stats.evicted;
             out["over_limit"] = stats.over_limit;
             out["readmitted"] = stats.readmitted;
             out["rejected"] = stats.rejected;
             return out;
           })
      .def("close", &PyFileCache::Close);
}

}  // namespace fanrun::bindings
