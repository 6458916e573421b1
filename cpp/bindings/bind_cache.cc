// Python access to the node-wide file cache; the engine fetches http(s):// itself, a Python
// callable the other remote sources.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <unistd.h>

#include <memory>

#include "call_without_gil.h"
#include "fanrun/file_cache.h"
#include "fanrun/http_fetch.h"
#include "fanrun/prefetch_local.h"
#include "status_to_python.h"

namespace nb = nanobind;

namespace fanrun::bindings {
namespace {

// Any object, as before any check; typed so that the stub says what it is for.
using FetchCallable = nb::typed<nb::object, nb::typed<nb::callable, void(std::string, std::string)>>;
using Counts = nb::typed<nb::dict, nb::str, uint64_t>;

// Whether Python has a signal to deliver: its handler runs here, and a KeyboardInterrupt it
// raises stays set, for the binding to raise once the engine has returned.
Status PythonSignals() {
  nb::gil_scoped_acquire gil;
  if (PyErr_Occurred() != nullptr || PyErr_CheckSignals() != 0) return Status::Invalid("Interrupted by a signal");
  return Status::OK();
}

// Owns the engine cache and the Python fetch callable. The cache's threads call the
// callable with the GIL taken only around the call; they are joined with the GIL
// released, or a thread waiting for the GIL would never finish.
class PyFileCache {
 public:
  PyFileCache(const std::string& dir, uint64_t limit_bytes, int threads, int attempts, FetchCallable fetch, bool native_http,
              double fetch_timeout_s, int64_t min_rate_bytes, int64_t min_rate_seconds, const std::string& ca_file,
              const std::string& ca_dir)
      : fetch_(std::move(fetch)),
        owner_pid_(::getpid()),
        main_thread_(nb::cast<unsigned long>(nb::module_::import_("threading").attr("main_thread")().attr("ident"))) {
    CacheOptions options;
    options.dir = dir;
    options.limit_bytes = limit_bytes;
    options.threads = threads;
    options.attempts = attempts;
    Fetcher fetcher = CopyLocalFile;
    if (!fetch_.is_none()) {
      PyObject* callable = fetch_.ptr();  // kept alive by fetch_ for as long as the threads run
      // http(s):// sources are fetched by the engine itself, without the GIL; every other
      // source goes to the callable.
      std::shared_ptr<HttpFetcher> http;
      if (native_http) {
        HttpOptions http_options;
        http_options.timeout_ms = static_cast<int64_t>(fetch_timeout_s * 1000);
        http_options.min_rate_bytes = min_rate_bytes;
        http_options.min_rate_seconds = min_rate_seconds;
        http_options.max_bytes = static_cast<int64_t>(limit_bytes);
        http_options.ca_file = ca_file;
        http_options.ca_dir = ca_dir;
        http = std::make_shared<HttpFetcher>(std::move(http_options));
      }
      fetcher = [callable, http](const CacheItem& item, const std::string& partial, const Interrupt& interrupt) -> Status {
        if (http != nullptr && HttpFetcher::Handles(item.source)) return http->Fetch(item, partial, interrupt);
        if (!nb::is_alive()) return Status::Invalid("The interpreter is shutting down");
        nb::gil_scoped_acquire gil;
        try {
          nb::handle function(callable);
          function(item.source, partial);
          return Status::OK();
        } catch (nb::python_error& error) {
          if (!error.matches(PyExc_Exception)) {
            // KeyboardInterrupt (Ctrl+C in the caller's fetch): not a failure to retry but
            // the caller's to see; the interrupt check finds it set.
            error.restore();
            return Status::Invalid("Interrupted by a signal");
          }
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

  // What a caller's wait in the engine asks: only the main thread runs Python's signal handlers.
  Interrupt CallerInterrupt() const {
    if (PyThread_get_thread_ident() != main_thread_) return nullptr;
    return PythonSignals;
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
  const unsigned long main_thread_;
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
  m.def("engine_fetches", &HttpFetcher::Handles, nb::arg("source"),
        "Whether a FileCache made with native_http fetches this source with the engine's own HTTP client\n"
        "(http:// and https://) rather than through its fetch callable: the one place that decides it.");
  auto prefetcher_class =
      nb::class_<PyLocalPrefetcher>(m, "LocalPrefetcher",
                                    "Native threads that bring local files not yet in the page cache into it: files of\n"
                                    "READ_THROUGH_BYTES or more are read through, smaller ones get the kernel's readahead\n"
                                    "(posix_fadvise WILLNEED); after a run of cached files, only one hint in 16 is looked at.");
  prefetcher_class.def(nb::init<int>(), nb::arg("threads"))
      .def("hint", [](PyLocalPrefetcher& self, std::vector<std::string> paths) { self.prefetcher().Hint(std::move(paths)); },
           nb::arg("paths"))
      .def("drain",
           [](PyLocalPrefetcher& self) {
             LocalPrefetcher& prefetcher = self.prefetcher();
             CallWithoutGil([&] { prefetcher.Drain(); });
           })
      .def(
          "wait",
          [](PyLocalPrefetcher& self, const std::string& path) {
            LocalPrefetcher& prefetcher = self.prefetcher();
            CallWithoutGil([&] { prefetcher.Wait(path); });
          },
          nb::arg("path"), "Until the hints given so far for path are done: a large file is then in the page cache.")
      .def(
          "stats",
          [](PyLocalPrefetcher& self) {
            const LocalPrefetcher::Counts counts = self.prefetcher().counts();
            Counts out;
            out["hinted"] = counts.hinted;
            out["resident"] = counts.resident;
            out["skipped"] = counts.skipped;
            out["failed"] = counts.failed;
            return out;
          },
          "hinted, resident (already in the page cache), skipped (not looked at), failed.");
  prefetcher_class.def_static(
      "resident", [](const std::string& path) { return LocalPrefetcher::Resident(path); }, nb::arg("path"),
      "Whether the file was read whole into the page cache (its last page is there); False if it cannot be opened.");
  prefetcher_class.attr("READ_THROUGH_BYTES") = LocalPrefetcher::kReadThroughBytes;
  nb::class_<PyFileCache>(m, "FileCache", nb::is_weak_referenceable(),
                          "A node-wide cache directory (file_cache.h) filled ahead of use by `threads` native threads.")
      .def(nb::init<const std::string&, uint64_t, int, int, FetchCallable, bool, double, int64_t, int64_t,
                    const std::string&, const std::string&>(),
           nb::arg("dir"), nb::arg("limit_bytes"), nb::arg("threads"), nb::arg("attempts"), nb::arg("fetch").none(),
           nb::arg("native_http") = false, nb::arg("fetch_timeout_s") = 0.0, nb::arg("min_rate_bytes") = 0,
           nb::arg("min_rate_seconds") = 0, nb::arg("ca_file") = "", nb::arg("ca_dir") = "",
           "fetch(source, partial_path) writes a remote file, called on the cache's threads; None copies local\n"
           "files. With native_http, the engine fetches http(s):// sources itself (libcurl) within these\n"
           "limits (0: none; limit_bytes bounds a body too) and trusts ca_file / ca_dir (\"\": the system's).")
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
            const Interrupt interrupt = self.CallerInterrupt();
            return CallWithoutGil([&] { return cache.Acquire(CacheItem{source, name, size}, interrupt); });
          },
          nb::arg("source"), nb::arg("name"), nb::arg("size"),
          "Waits (GIL released) and returns the cached path, in use until release(). A signal in the main\n"
          "thread (Ctrl+C) ends the wait within about 0.1 s and raises its exception.")
      .def("release", [](PyFileCache& self, const std::string& name) { self.cache().Release(name); }, nb::arg("name"))
      .def("release_all", [](PyFileCache& self) { self.cache().ReleaseAll(); })
      .def("stats",
           [](PyFileCache& self) {
             CacheStats stats = self.cache().Stats();
             Counts out;
             out["hits"] = stats.hits;
             out["fetched"] = stats.fetched;
             out["bytes_fetched"] = stats.bytes_fetched;
             out["retries"] = stats.retries;
             out["evicted"] = stats.evicted;
             out["over_limit"] = stats.over_limit;
             out["readmitted"] = stats.readmitted;
             out["rejected"] = stats.rejected;
             return out;
           },
           "hits, fetched, bytes_fetched, retries, evicted, over_limit, readmitted, rejected (file_cache.h).")
      .def("close", &PyFileCache::Close);
}

}  // namespace fanrun::bindings
