// HttpFetcher: the cache's own client for http:// sources, so that many small files cost one
// request each on a kept-alive connection, not a connection each and a trip through Python.
#pragma once

#include <cstdint>
#include <mutex>
#include <string>
#include <unordered_map>

#include "fanrun/fd.h"
#include "fanrun/file_cache.h"
#include "fanrun/status.h"

namespace fanrun {

struct HttpUrl {
  std::string host;
  std::string port;    // "80" when the URL names none
  std::string target;  // the path and query, "/" at least
};

// False for anything but a plain http:// URL with a host (https included: left to fsspec).
bool ParseHttpUrl(const std::string& url, HttpUrl* out);

class HttpFetcher {
 public:
  explicit HttpFetcher(int timeout_ms = 60000) : timeout_ms_(timeout_ms) {}

  // Writes the body of a 200 answer to partial_path. Sets *fall_back, and returns OK, for what
  // it leaves to another fetcher: a URL that is not http://, a redirect, a body without a
  // Content-Length (chunked). Any other answer is an error that names its status and the URL.
  // Safe to call from several threads at once.
  Status Fetch(const CacheItem& item, const std::string& partial_path, bool* fall_back);

  uint64_t connections_made() const;

 private:
  struct Exchange;
  Result<FileDescriptor> Connect(const HttpUrl& url);
  FileDescriptor TakeIdle(const std::string& key);
  void PutIdle(const std::string& key, FileDescriptor connection);

  const int timeout_ms_;
  mutable std::mutex mutex_;
  std::unordered_multimap<std::string, FileDescriptor> idle_;  // "host:port" -> connections
  uint64_t connections_made_ = 0;
};

}  // namespace fanrun
