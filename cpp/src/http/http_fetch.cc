// HttpFetcher: GET through libcurl, one easy and one multi handle per session, the sessions
// (and the connections their multi handles keep alive) reused between fetches.
#include "fanrun/http_fetch.h"

#include <curl/curl.h>
#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <string_view>
#include <utility>

#include "http/http_message_internal.h"

namespace fanrun {
namespace {

constexpr long kConnectTimeoutMs = 60000;
constexpr long kMaxRedirects = 10;
// What one read from the socket may take: fewer calls for large files.
constexpr long kReceiveBufferBytes = 512 * 1024;
// libcurl hands the body over in pieces of 16 KiB at most; they are written in pieces of this.
constexpr size_t kWriteBytes = 1 << 20;

CURLcode GlobalInit() {
  // curl_global_init must not run twice at once; a function-local static runs it once.
  static const CURLcode code = curl_global_init(CURL_GLOBAL_DEFAULT);
  return code;
}

// One GET: where its body goes and why a callback stopped it, shared with libcurl's callbacks.
struct Transfer {
  Transfer(const CacheItem& wanted, const std::string& partial, const HttpOptions& limits, std::string& buffer)
      : item(wanted), partial_path(partial), options(limits), unwritten(buffer) {
    unwritten.clear();
  }

  const CacheItem& item;
  const std::string& partial_path;
  const HttpOptions& options;
  internal::ResponseHead head;
  Status stopped;  // why a callback stopped the transfer
  FileDescriptor out;
  std::string& unwritten;  // body bytes not yet written to `out`, in the session's buffer
  uint64_t received = 0;  // body bytes taken, written or not
  char error[CURL_ERROR_SIZE] = {};

  std::string Url() const { return internal::Printable(item.source); }

  // A count other than the one handed over makes libcurl abort the transfer.
  size_t Stop(Status why) {
    stopped = std::move(why);
    return 0;
  }

  static size_t OnHeader(char* data, size_t size, size_t count, void* self) {
    auto* transfer = static_cast<Transfer*>(self);
    const bool was_complete = transfer->head.complete();
    Status added = transfer->head.AddLine(std::string_view(data, size * count));
    if (!added.ok()) return transfer->Stop(Status::IOError("The answer for '", transfer->Url(), "' ", added.message()));
    if (!was_complete && transfer->head.complete()) {
      Status accepted = transfer->HeadDone();
      if (!accepted.ok()) return transfer->Stop(std::move(accepted));
    }
    return size * count;
  }

  // Only the body of the final answer comes here: libcurl skips those of redirects.
  static size_t OnBody(char* data, size_t size, size_t count, void* self) {
    auto* transfer = static_cast<Transfer*>(self);
    const size_t bytes = size * count;
    if (!transfer->out.valid()) {
      Status opened = transfer->Open();
      if (!opened.ok()) return transfer->Stop(std::move(opened));
    }
    const uint64_t after = transfer->received + bytes;
    if (transfer->item.size >= 0 && after > static_cast<uint64_t>(transfer->item.size)) {
      return transfer->Stop(Status::IOError("'", transfer->Url(), "' sent more than the ", transfer->item.size,
                                            " bytes its listing gave; the rest was not read"));
    }
    if (transfer->options.max_bytes > 0 && after > static_cast<uint64_t>(transfer->options.max_bytes)) {
      return transfer->Stop(TooLarge(transfer->Url(), transfer->options.max_bytes));
    }
    transfer->unwritten.append(data, bytes);
    transfer->received = after;
    if (transfer->unwritten.size() >= kWriteBytes) {
      Status wrote = transfer->Flush();
      if (!wrote.ok()) return transfer->Stop(std::move(wrote));
    }
    return bytes;
  }

  Status Flush() {
    Status wrote = WriteToCacheFile(out.fd(), unwritten.data(), unwritten.size(), partial_path);
    unwritten.clear();
    return wrote;
  }

  static Status TooLarge(const std::string& url, int64_t max_bytes) {
    return Status::IOError("'", url, "' is larger than the cache's limit of ", max_bytes,
                           " bytes; the rest was not read: raise cache_limit to cache it");
  }

  Status Open() {
    FANRUN_ASSIGN_OR_RETURN(out, OpenFile(partial_path, O_WRONLY | O_TRUNC | O_NOFOLLOW));
    unwritten.reserve(kWriteBytes + CURL_MAX_WRITE_SIZE);  // once per session: the buffer is kept
    return Status::OK();
  }

  // The head of an answer has come: its body is read only for a 200 that may be right.
  Status HeadDone() const {
    const int status = head.status();
    if (status >= 100 && status < 200) return Status::OK();                      // interim: the answer follows
    if (status >= 300 && status < 400 && head.has_location()) return Status::OK();  // followed by libcurl
    if (status != 200) {
      const std::string reason = head.reason().empty() ? "" : " " + internal::Printable(head.reason());
      return Status::IOError("HTTP ", status, reason, " for '", Url(), "'");
    }
    const int64_t length = head.content_length();
    if (length >= 0 && item.size >= 0 && length != item.size) {
      return Status::IOError("'", Url(), "' announces ", length, " bytes where its listing gave ", item.size);
    }
    if (length >= 0 && options.max_bytes > 0 && length > options.max_bytes) return TooLarge(Url(), options.max_bytes);
    return Status::OK();
  }

  // What the transfer came to, once libcurl has finished it with `result`.
  Status Outcome(CURLcode result) {
    if (!stopped.ok()) return stopped;
    if (result == CURLE_OK) {
      if (!out.valid()) FANRUN_RETURN_NOT_OK(Open());  // an empty body calls no callback
      FANRUN_RETURN_NOT_OK(Flush());
      return out.Close();
    }
    const std::string why = error[0] != '\0' ? error : curl_easy_strerror(result);
    switch (result) {
      case CURLE_OPERATION_TIMEDOUT:
        if (why.rfind("Operation too slow", 0) == 0) {
          return Status::IOError("'", Url(), "' came at less than ", options.min_rate_bytes, " bytes/s for ",
                                 options.min_rate_seconds, " s (", received, " bytes of its body had come): ", why,
                                 "; min_fetch_rate sets this limit");
        }
        if (options.timeout_ms > 0 && why.rfind("Operation timed out", 0) == 0) {
          return Status::IOError("'", Url(), "' was not fetched within its deadline of ", static_cast<double>(options.timeout_ms) / 1000,
                                 " s (", received, " bytes of its body had come): ", why, "; fetch_timeout sets this deadline");
        }
        // A deadline no longer than the connection's own limit is what ended a connection
        // that never completed (a server whose accept queue is full drops the handshake).
        if (options.timeout_ms > 0 && options.timeout_ms <= kConnectTimeoutMs && why.rfind("Connection timed out", 0) == 0) {
          return Status::IOError("'", Url(), "' was not connected to within its deadline of ",
                                 static_cast<double>(options.timeout_ms) / 1000, " s: ", why, "; fetch_timeout sets this deadline");
        }
        break;
      case CURLE_PARTIAL_FILE:
        if (head.content_length() >= 0) {
          return Status::DataLoss("'", Url(), "' ended after ", received, " of the ", head.content_length(),
                                  " bytes its server announced");
        }
        return Status::DataLoss("'", Url(), "' ended after ", received, " bytes, before its body's end: ", why);
      case CURLE_PEER_FAILED_VERIFICATION:
      case CURLE_SSL_CACERT_BADFILE:
        return Status::IOError("The certificate of '", Url(), "' was not verified: ", why,
                               "; name the authority that signed it with SSL_CERT_FILE or CURL_CA_BUNDLE");
      default:
        break;
    }
    return Status::IOError("Failed to fetch '", Url(), "': ", why);
  }
};

}  // namespace

// The handles of one fetch at a time, and the sockets of the connections they keep alive,
// which libcurl opens and closes through the callbacks below.
struct HttpFetcher::Session {
  struct MultiCleanup {
    void operator()(CURLM* handle) const { curl_multi_cleanup(handle); }
  };
  struct EasyCleanup {
    void operator()(CURL* handle) const { curl_easy_cleanup(handle); }
  };

  ~Session() {
    easy.reset();  // before the multi handle, as libcurl asks; that one closes the connections
    multi.reset();
  }

  static curl_socket_t OpenSocket(void* self, curlsocktype, curl_sockaddr* address) {
    const int fd = ::socket(address->family, address->socktype | SOCK_CLOEXEC, address->protocol);
    if (fd >= 0) static_cast<Session*>(self)->sockets.push_back(fd);
    return fd >= 0 ? fd : CURL_SOCKET_BAD;
  }

  static int CloseSocket(void* self, curl_socket_t fd) {
    std::vector<int>& sockets = static_cast<Session*>(self)->sockets;
    sockets.erase(std::remove(sockets.begin(), sockets.end(), fd), sockets.end());
    return ::close(fd);
  }

  // Whether a connection kept alive has bytes no request asked for, or was closed. Bytes a
  // server sent after an answer would be read as the answer to the next request on that
  // connection (libcurl 7.88 reuses a connection with input pending): such a session is
  // dropped, and its connections with it. (An HTTP/2 server's PING or GOAWAY on an idle
  // connection drops it too: a new connection, nothing worse.)
  bool HasUnaskedInput() const {
    std::vector<pollfd> kept;
    for (int fd : sockets) kept.push_back(pollfd{fd, POLLIN, 0});
    return !kept.empty() && ::poll(kept.data(), kept.size(), 0) != 0;
  }

  std::vector<int> sockets;
  std::string body_buffer;  // Transfer::unwritten
  std::unique_ptr<CURLM, MultiCleanup> multi;
  std::unique_ptr<CURL, EasyCleanup> easy;
};

HttpFetcher::HttpFetcher(HttpOptions options) : options_(std::move(options)) {}

HttpFetcher::~HttpFetcher() = default;

bool HttpFetcher::Handles(const std::string& source) { return internal::IsHttpUrl(source); }

Result<std::unique_ptr<HttpFetcher::Session>> HttpFetcher::TakeSession() {
  while (true) {
    std::unique_ptr<Session> session;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (idle_.empty()) break;
      session = std::move(idle_.back());
      idle_.pop_back();
    }
    if (!session->HasUnaskedInput()) return session;
  }
  const CURLcode init = GlobalInit();
  if (init != CURLE_OK) return Status::Internal("libcurl did not start: ", curl_easy_strerror(init));
  auto session = std::make_unique<Session>();
  session->multi.reset(curl_multi_init());
  session->easy.reset(curl_easy_init());
  if (session->multi == nullptr || session->easy == nullptr) return Status::Internal("libcurl could not make a handle");
  CURL* easy = session->easy.get();
  CURLcode code = CURLE_OK;
  auto set = [&](CURLoption option, auto value) {
    if (code == CURLE_OK) code = curl_easy_setopt(easy, option, value);
  };
  set(CURLOPT_OPENSOCKETFUNCTION, &Session::OpenSocket);
  set(CURLOPT_OPENSOCKETDATA, session.get());
  set(CURLOPT_CLOSESOCKETFUNCTION, &Session::CloseSocket);
  set(CURLOPT_CLOSESOCKETDATA, session.get());
  set(CURLOPT_NOSIGNAL, 1L);  // no SIGALRM for timeouts: threads and Python's handlers share this process
  set(CURLOPT_PROTOCOLS_STR, "http,https");
  set(CURLOPT_REDIR_PROTOCOLS_STR, "http,https");
  set(CURLOPT_FOLLOWLOCATION, 1L);
  set(CURLOPT_MAXREDIRS, kMaxRedirects);
  set(CURLOPT_USERAGENT, "fanrun");
  set(CURLOPT_SUPPRESS_CONNECT_HEADERS, 1L);  // a proxy's CONNECT answer is not the file's head
  set(CURLOPT_HEADERFUNCTION, &Transfer::OnHeader);
  set(CURLOPT_WRITEFUNCTION, &Transfer::OnBody);
  set(CURLOPT_BUFFERSIZE, kReceiveBufferBytes);
  set(CURLOPT_CONNECTTIMEOUT_MS, kConnectTimeoutMs);
  set(CURLOPT_TIMEOUT_MS, static_cast<long>(options_.timeout_ms));
  if (options_.min_rate_seconds > 0) {
    set(CURLOPT_LOW_SPEED_LIMIT, static_cast<long>(options_.min_rate_bytes));
    set(CURLOPT_LOW_SPEED_TIME, static_cast<long>(options_.min_rate_seconds));
  }
  if (!options_.ca_file.empty()) set(CURLOPT_CAINFO, options_.ca_file.c_str());
  if (!options_.ca_dir.empty()) set(CURLOPT_CAPATH, options_.ca_dir.c_str());
  if (code != CURLE_OK) return Status::Internal("libcurl refused an option: ", curl_easy_strerror(code));
  return session;
}

void HttpFetcher::PutSession(std::unique_ptr<Session> session) {
  std::lock_guard<std::mutex> lock(mutex_);
  idle_.push_back(std::move(session));
}

Status HttpFetcher::Fetch(const CacheItem& item, const std::string& partial_path, const Interrupt& interrupt) {
  FANRUN_ASSIGN_OR_RETURN(const std::string url, internal::RequestUrl(item.source));
  FANRUN_ASSIGN_OR_RETURN(std::unique_ptr<Session> session, TakeSession());
  CURL* easy = session->easy.get();
  CURLM* multi = session->multi.get();
  Transfer transfer(item, partial_path, options_, session->body_buffer);
  CURLcode set = curl_easy_setopt(easy, CURLOPT_URL, url.c_str());
  if (set == CURLE_OK) set = curl_easy_setopt(easy, CURLOPT_HEADERDATA, &transfer);
  if (set == CURLE_OK) set = curl_easy_setopt(easy, CURLOPT_WRITEDATA, &transfer);
  if (set == CURLE_OK) set = curl_easy_setopt(easy, CURLOPT_ERRORBUFFER, transfer.error);
  if (set != CURLE_OK) return Status::Invalid("libcurl refused '", transfer.Url(), "': ", curl_easy_strerror(set));
  if (curl_multi_add_handle(multi, easy) != CURLM_OK) return Status::Internal("libcurl could not start a transfer");

  // The transfer is driven here, not by curl_easy_perform, so that this thread wakes at least
  // every kInterruptCheckMs to ask `interrupt`, even while the server sends nothing.
  Status interrupted;
  CURLcode result = CURLE_OK;
  auto last_asked = std::chrono::steady_clock::now();
  while (true) {
    int running = 0;
    CURLMcode driven = curl_multi_perform(multi, &running);
    if (driven == CURLM_OK && running == 0) {
      int left = 0;
      while (CURLMsg* message = curl_multi_info_read(multi, &left)) {
        if (message->msg == CURLMSG_DONE) result = message->data.result;
      }
      break;
    }
    if (driven == CURLM_OK) driven = curl_multi_poll(multi, nullptr, 0, kInterruptCheckMs, nullptr);
    if (driven != CURLM_OK) {
      interrupted = Status::Internal("libcurl failed while fetching '", transfer.Url(), "': ", curl_multi_strerror(driven));
      break;
    }
    const auto now = std::chrono::steady_clock::now();
    if (interrupt && now - last_asked >= std::chrono::milliseconds(kInterruptCheckMs)) {
      last_asked = now;
      interrupted = interrupt();
      if (!interrupted.ok()) break;
    }
  }
  // A transfer that did not finish is abandoned here, and its connection closed.
  (void)curl_multi_remove_handle(multi, easy);
  (void)curl_easy_setopt(easy, CURLOPT_ERRORBUFFER, nullptr);  // the buffer dies with this call
  long connects = 0;
  if (curl_easy_getinfo(easy, CURLINFO_NUM_CONNECTS, &connects) == CURLE_OK && connects > 0) {
    connections_made_ += static_cast<uint64_t>(connects);
  }
  // Before the session goes back: the last of the body is still in its buffer.
  Status outcome = interrupted.ok() ? transfer.Outcome(result) : interrupted;
  PutSession(std::move(session));
  return outcome;
}

}  // namespace fanrun
