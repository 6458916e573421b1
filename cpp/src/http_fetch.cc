// HttpFetcher: HTTP/1.1 GET over plain TCP, connections kept per server between fetches.
#include "fanrun/http_fetch.h"

#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cctype>
#include <cstdlib>
#include <utility>
#include <vector>

namespace fanrun {
namespace {

constexpr size_t kMaxHeaderBytes = 64 * 1024;
constexpr size_t kBodyChunk = 1 << 20;

std::string Lower(std::string text) {
  std::transform(text.begin(), text.end(), text.begin(), [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return text;
}

std::string Trim(const std::string& text) {
  const size_t begin = text.find_first_not_of(" \t");
  if (begin == std::string::npos) return "";
  return text.substr(begin, text.find_last_not_of(" \t") - begin + 1);
}

// What the answer's head says.
struct Head {
  int status = 0;
  std::string reason;
  int64_t content_length = -1;
  bool chunked = false;
  bool keep_alive = true;
};

bool ParseHead(const std::string& text, Head* head) {
  const size_t line_end = text.find("\r\n");
  const std::string status_line = text.substr(0, line_end);
  if (status_line.rfind("HTTP/1.", 0) != 0 || status_line.size() < 12) return false;
  head->keep_alive = status_line[7] == '1';  // HTTP/1.0 closes unless it says otherwise
  head->status = std::atoi(status_line.c_str() + 9);
  head->reason = status_line.size() > 13 ? status_line.substr(13) : "";
  size_t at = line_end + 2;
  while (at < text.size()) {
    const size_t end = text.find("\r\n", at);
    const std::string line = text.substr(at, end == std::string::npos ? std::string::npos : end - at);
    at = end == std::string::npos ? text.size() : end + 2;
    const size_t colon = line.find(':');
    if (colon == std::string::npos) continue;
    const std::string name = Lower(Trim(line.substr(0, colon)));
    const std::string value = Trim(line.substr(colon + 1));
    if (name == "content-length") {
      char* parse_end = nullptr;
      const long long length = std::strtoll(value.c_str(), &parse_end, 10);
      if (parse_end == value.c_str() || length < 0) return false;
      head->content_length = length;
    } else if (name == "transfer-encoding") {
      head->chunked = Lower(value) != "identity";
    } else if (name == "connection") {
      const std::string lowered = Lower(value);
      if (lowered.find("close") != std::string::npos) head->keep_alive = false;
      if (lowered.find("keep-alive") != std::string::npos) head->keep_alive = true;
    }
  }
  return true;
}

Status SetTimeouts(int fd, int timeout_ms) {
  timeval tv{};
  tv.tv_sec = timeout_ms / 1000;
  tv.tv_usec = static_cast<suseconds_t>((timeout_ms % 1000) * 1000);
  if (::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv)) != 0 ||
      ::setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv)) != 0) {
    return Status::IOErrorFromErrno(errno, "Failed to set a socket's timeouts");
  }
  return Status::OK();
}

}  // namespace

bool ParseHttpUrl(const std::string& url, HttpUrl* out) {
  const std::string scheme = "http://";
  if (url.size() <= scheme.size() || Lower(url.substr(0, scheme.size())) != scheme) return false;
  const size_t authority_end = url.find_first_of("/?#", scheme.size());
  const std::string authority = url.substr(scheme.size(), authority_end == std::string::npos ? std::string::npos : authority_end - scheme.size());
  if (authority.empty() || authority.find('@') != std::string::npos || authority[0] == '[') return false;  // credentials, IPv6: fsspec's
  const size_t colon = authority.find(':');
  out->host = authority.substr(0, colon);
  out->port = colon == std::string::npos ? "80" : authority.substr(colon + 1);
  if (out->host.empty() || out->port.empty() || out->port.find_first_not_of("0123456789") != std::string::npos) return false;
  std::string target = authority_end == std::string::npos ? "/" : url.substr(authority_end);
  const size_t fragment = target.find('#');
  if (fragment != std::string::npos) target.erase(fragment);
  if (target.empty() || target[0] != '/') target.insert(0, "/");
  out->target = target;
  return true;
}

uint64_t HttpFetcher::connections_made() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return connections_made_;
}

FileDescriptor HttpFetcher::TakeIdle(const std::string& key) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto found = idle_.find(key);
  if (found == idle_.end()) return FileDescriptor();
  FileDescriptor connection = std::move(found->second);
  idle_.erase(found);
  return connection;
}

void HttpFetcher::PutIdle(const std::string& key, FileDescriptor connection) {
  std::lock_guard<std::mutex> lock(mutex_);
  idle_.emplace(key, std::move(connection));
}

Result<FileDescriptor> HttpFetcher::Connect(const HttpUrl& url) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  const int rc = ::getaddrinfo(url.host.c_str(), url.port.c_str(), &hints, &found);
  if (rc != 0) return Status::IOError("Cannot resolve '", url.host, "': ", ::gai_strerror(rc));
  Status last = Status::IOError("No address for '", url.host, "'");
  for (addrinfo* address = found; address != nullptr; address = address->ai_next) {
    FileDescriptor socket_fd(::socket(address->ai_family, address->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, address->ai_protocol));
    if (!socket_fd.valid()) {
      last = Status::IOErrorFromErrno(errno, "Failed to open a socket");
      continue;
    }
    // Non-blocking connect, waited for with poll: an unreachable server costs the timeout.
    int connected = ::connect(socket_fd.fd(), address->ai_addr, address->ai_addrlen);
    if (connected != 0 && errno == EINPROGRESS) {
      pollfd wait{socket_fd.fd(), POLLOUT, 0};
      int ready;
      do {
        ready = ::poll(&wait, 1, timeout_ms_);
      } while (ready < 0 && errno == EINTR);
      int error = ready == 0 ? ETIMEDOUT : 0;
      socklen_t size = sizeof(error);
      if (ready > 0) ::getsockopt(socket_fd.fd(), SOL_SOCKET, SO_ERROR, &error, &size);
      connected = error == 0 ? 0 : -1;
      errno = error;
    }
    if (connected != 0) {
      last = Status::IOErrorFromErrno(errno, "Failed to connect to ", url.host, ":", url.port);
      continue;
    }
    const int flags = ::fcntl(socket_fd.fd(), F_GETFL);
    ::fcntl(socket_fd.fd(), F_SETFL, flags & ~O_NONBLOCK);
    const int one = 1;
    ::setsockopt(socket_fd.fd(), IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    Status timeouts = SetTimeouts(socket_fd.fd(), timeout_ms_);
    if (!timeouts.ok()) {
      last = timeouts;
      continue;
    }
    ::freeaddrinfo(found);
    std::lock_guard<std::mutex> lock(mutex_);
    ++connections_made_;
    return socket_fd;
  }
  ::freeaddrinfo(found);
  return last;
}

// One request and its answer on one connection.
struct HttpFetcher::Exchange {
  int fd;
  const HttpUrl& url;
  const CacheItem& item;
  int timeout_ms;
  bool answered = false;  // some byte of the answer came: the connection was alive
  bool reusable = false;

  Status ReadFailed(int err) const {
    if (err == EAGAIN || err == EWOULDBLOCK) {
      return Status::IOError("No answer from ", url.host, ":", url.port, " for '", item.source, "' within ", timeout_ms / 1000, " s");
    }
    return Status::IOErrorFromErrno(err, "Failed to read the answer for '", item.source, "'");
  }

  Status Run(const std::string& partial_path, bool* fall_back) {
    std::string request = "GET " + url.target + " HTTP/1.1\r\nHost: " + url.host;
    if (url.port != "80") request += ":" + url.port;
    request += "\r\nUser-Agent: fanrun\r\nAccept-Encoding: identity\r\nConnection: keep-alive\r\n\r\n";
    for (size_t sent = 0; sent < request.size();) {
      const ssize_t n = ::send(fd, request.data() + sent, request.size() - sent, MSG_NOSIGNAL);
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) return Status::IOErrorFromErrno(errno, "Failed to send the request for '", item.source, "'");
      sent += static_cast<size_t>(n);
    }
    std::string head_text;
    std::vector<char> buffer(kBodyChunk);
    size_t head_end = std::string::npos;
    while (head_end == std::string::npos) {
      const ssize_t n = ::recv(fd, buffer.data(), buffer.size(), 0);
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) return ReadFailed(errno);
      if (n == 0) return Status::IOError("The server closed the connection before answering for '", item.source, "'");
      answered = true;
      head_text.append(buffer.data(), static_cast<size_t>(n));
      head_end = head_text.find("\r\n\r\n");
      if (head_end == std::string::npos && head_text.size() > kMaxHeaderBytes) {
        return Status::IOError("The answer for '", item.source, "' has a head over ", kMaxHeaderBytes, " bytes");
      }
    }
    Head head;
    if (!ParseHead(head_text.substr(0, head_end + 2), &head)) {
      return Status::IOError("The answer for '", item.source, "' is not HTTP/1.x: '", head_text.substr(0, head_text.find("\r\n")), "'");
    }
    std::string body = head_text.substr(head_end + 4);  // the part of the body read with the head
    if (head.chunked || head.content_length < 0 || (head.status >= 300 && head.status < 400)) {
      *fall_back = true;  // the connection is not reused: the rest of the answer was not read
      return Status::OK();
    }
    FileDescriptor out;
    if (head.status == 200) {
      FANRUN_ASSIGN_OR_RETURN(out, OpenFile(partial_path, O_WRONLY | O_CREAT | O_TRUNC, 0644));
    }
    // The body: written out for a 200, read and dropped otherwise, so the connection can serve again.
    uint64_t remaining = static_cast<uint64_t>(head.content_length);
    auto take = [&](const char* data, size_t size) -> Status {
      const size_t used = static_cast<size_t>(std::min<uint64_t>(size, remaining));
      remaining -= used;
      return out.valid() ? WriteToCacheFile(out.fd(), data, used, partial_path) : Status::OK();
    };
    FANRUN_RETURN_NOT_OK(take(body.data(), body.size()));
    while (remaining > 0) {
      const ssize_t n = ::recv(fd, buffer.data(), static_cast<size_t>(std::min<uint64_t>(buffer.size(), remaining)), 0);
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) return ReadFailed(errno);
      if (n == 0) {
        return Status::DataLoss("'", item.source, "' ended after ", static_cast<uint64_t>(head.content_length) - remaining, " of the ",
                                head.content_length, " bytes its server announced");
      }
      FANRUN_RETURN_NOT_OK(take(buffer.data(), static_cast<size_t>(n)));
    }
    reusable = head.keep_alive;
    if (head.status != 200) {
      return Status::IOError("HTTP ", head.status, " ", head.reason, " for '", item.source, "'");
    }
    return out.Close();
  }
};

Status HttpFetcher::Fetch(const CacheItem& item, const std::string& partial_path, bool* fall_back) {
  *fall_back = false;
  HttpUrl url;
  if (!ParseHttpUrl(item.source, &url)) {
    *fall_back = true;
    return Status::OK();
  }
  const std::string key = url.host + ":" + url.port;
  bool answered = false;
  bool reusable = false;
  auto exchange = [&](int fd) {
    Exchange one{fd, url, item, timeout_ms_};
    Status status = one.Run(partial_path, fall_back);
    answered = one.answered;
    reusable = one.reusable;
    return status;
  };
  FileDescriptor connection = TakeIdle(key);
  const bool reused = connection.valid();
  if (!reused) {
    FANRUN_ASSIGN_OR_RETURN(connection, Connect(url));
  }
  Status status = exchange(connection.fd());
  if (reused && !answered && !status.ok()) {
    // The server closed the connection while it was idle: one new connection, once.
    FANRUN_ASSIGN_OR_RETURN(connection, Connect(url));
    status = exchange(connection.fd());
  }
  if (reusable && !*fall_back) PutIdle(key, std::move(connection));
  return status;
}

}  // namespace fanrun
