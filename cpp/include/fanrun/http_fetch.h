// HttpFetcher: the cache's own client for http:// and https:// sources, on libcurl, so that
// many small files cost one request each on a kept-alive connection, not a connection each
// and a trip through Python, and so that every fetch has a deadline, a minimum rate and a
// size it may not pass.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "fanrun/file_cache.h"
#include "fanrun/status.h"

namespace fanrun {

struct HttpOptions {
  int64_t timeout_ms = 0;       // each attempt at a file, from connecting to the last byte; 0: none
  int64_t min_rate_bytes = 0;   // an attempt that moves fewer bytes a second than this...
  int64_t min_rate_seconds = 0; // ...for this many seconds in a row fails; 0: no minimum
  int64_t max_bytes = 0;        // a body longer than this fails (the cache's limit); 0: none
  std::string ca_file;          // certificate authorities for https (PEM); "": the system's
  std::string ca_dir;           // a directory of them, hashed as OpenSSL's c_rehash does
};

class HttpFetcher {
 public:
  explicit HttpFetcher(HttpOptions options = {});
  ~HttpFetcher();
  HttpFetcher(const HttpFetcher&) = delete;
  HttpFetcher& operator=(const HttpFetcher&) = delete;

  // Whether Fetch takes this source: an http:// or https:// URL.
  static bool Handles(const std::string& source);

  // Writes the body of the 200 answer for item.source to partial_path, following redirects.
  // The URL's path is percent-encoded where it must be, and a URL with a control character
  // is refused. Any other status, a Content-Length that is not one plain number, a body
  // longer than item.size or max_bytes, a short body, the deadline or too slow a transfer
  // is an error naming the URL; the body of an error answer is not read, and a connection
  // whose answer was not read exactly to its end is closed, never used again. Gives up
  // within about kInterruptCheckMs once `interrupt` says so. Safe to call from several
  // threads at once: each call takes a connection of its own from those kept alive.
  Status Fetch(const CacheItem& item, const std::string& partial_path, const Interrupt& interrupt = nullptr);

  uint64_t connections_made() const { return connections_made_.load(); }

 private:
  struct Session;
  Result<std::unique_ptr<Session>> TakeSession();
  void PutSession(std::unique_ptr<Session> session);

  const HttpOptions options_;
  std::mutex mutex_;
  std::vector<std::unique_ptr<Session>> idle_;  // each holds the connections its transfers left open
  std::atomic<uint64_t> connections_made_{0};
};

}  // namespace fanrun
