#include "fanrun/http_fetch.h"

#include <netinet/in.h>
#include <sys/socket.h>
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <fstream>
#include <functional>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "common/test_util_internal.h"

namespace fanrun {
namespace {

using Clock = std::chrono::steady_clock;

double SecondsSince(Clock::time_point start) { return std::chrono::duration<double>(Clock::now() - start).count(); }

// A real HTTP server on 127.0.0.1 for one test, a thread per connection: each request's head
// goes to `answer`, which writes to the connection whatever the test wants a server to write
// (and returns false to close the connection).
class TestServer {
 public:
  using Answer = std::function<bool(TestServer& server, int connection, const std::string& request)>;

  explicit TestServer(Answer answer) : answer_(std::move(answer)) {
    listener_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in address{};
    address.sin_family = AF_INET;
    address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    EXPECT_EQ(::bind(listener_, reinterpret_cast<sockaddr*>(&address), sizeof(address)), 0);
    socklen_t size = sizeof(address);
    ::getsockname(listener_, reinterpret_cast<sockaddr*>(&address), &size);
    port_ = ntohs(address.sin_port);
    EXPECT_EQ(::listen(listener_, 8), 0);
    thread_ = std::thread([this] { Serve(); });
  }

  ~TestServer() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stopping_ = true;
      for (int connection : connections_) ::shutdown(connection, SHUT_RDWR);
    }
    stopped_.notify_all();
    ::shutdown(listener_, SHUT_RDWR);
    thread_.join();
    for (std::thread& served : served_) served.join();
    ::close(listener_);
  }

  std::string Url(const std::string& path) const { return "http://127.0.0.1:" + std::to_string(port_) + path; }
  int port() const { return port_; }
  int accepted() const { return accepted_.load(); }
  uint64_t bytes_sent() const { return bytes_sent_.load(); }
  std::vector<std::string> requests() {
    std::lock_guard<std::mutex> lock(mutex_);
    return requests_;
  }

  // For answers: false once the client closed the connection or the test is over.
  bool Send(int connection, const std::string& data) {
    const ssize_t n = ::send(connection, data.data(), data.size(), MSG_NOSIGNAL);
    if (n > 0) bytes_sent_ += static_cast<uint64_t>(n);
    return n == static_cast<ssize_t>(data.size());
  }
  // For answers: waits `ms`, or less when the test ends; false then.
  bool Pause(int ms) {
    std::unique_lock<std::mutex> lock(mutex_);
    return !stopped_.wait_for(lock, std::chrono::milliseconds(ms), [this] { return stopping_; });
  }

 private:
  void Serve() {
    while (true) {
      const int connection = ::accept4(listener_, nullptr, nullptr, SOCK_CLOEXEC);
      if (connection < 0) return;
      ++accepted_;
      std::lock_guard<std::mutex> lock(mutex_);
      if (stopping_) {
        ::close(connection);
        return;
      }
      connections_.push_back(connection);
      served_.emplace_back([this, connection] { ServeConnection(connection); });
    }
  }

  void ServeConnection(int connection) {
    std::string pending;
    while (true) {
      size_t end;
      while ((end = pending.find("\r\n\r\n")) == std::string::npos) {
        char buffer[4096];
        const ssize_t n = ::recv(connection, buffer, sizeof(buffer), 0);
        if (n <= 0) break;
        pending.append(buffer, static_cast<size_t>(n));
      }
      if (end == std::string::npos) break;
      const std::string request = pending.substr(0, end + 4);
      pending.erase(0, end + 4);
      {
        std::lock_guard<std::mutex> lock(mutex_);
        requests_.push_back(request);
      }
      if (!answer_(*this, connection, request)) break;
    }
    std::lock_guard<std::mutex> lock(mutex_);
    connections_.erase(std::find(connections_.begin(), connections_.end(), connection));
    ::close(connection);
  }

  Answer answer_;
  int listener_ = -1;
  int port_ = 0;
  std::atomic<int> accepted_{0};
  std::atomic<uint64_t> bytes_sent_{0};
  std::mutex mutex_;
  std::condition_variable stopped_;
  bool stopping_ = false;
  std::vector<int> connections_;
  std::vector<std::string> requests_;
  std::vector<std::thread> served_;
  std::thread thread_;
};

std::string Target(const std::string& request) {
  const size_t start = request.find(' ') + 1;
  return request.substr(start, request.find(' ', start) - start);
}

std::string Ok(const std::string& body) {
  return "HTTP/1.1 200 OK\r\nContent-Length: " + std::to_string(body.size()) + "\r\n\r\n" + body;
}

// Answers each request with the next of `answers`, on any connection; closes it after the last.
TestServer::Answer Canned(std::vector<std::string> answers) {
  auto next = std::make_shared<size_t>(0);
  return [answers = std::move(answers), next](TestServer& server, int connection, const std::string&) {
    if (*next >= answers.size()) return false;
    return server.Send(connection, answers[(*next)++]) && *next < answers.size();
  };
}

// Answers with the body named by the path ("/hello" -> "hello").
bool Echo(TestServer& server, int connection, const std::string& request) {
  return server.Send(connection, Ok(Target(request).substr(1)));
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

class HttpFetchTest : public ::testing::Test {
 protected:
  void SetUp() override { dir_ = testing::MakeTempDir("fanrun-http-fetch-test"); }
  void TearDown() override { ASSERT_TRUE(testing::RemoveTree(dir_)); }
  std::string Path(const std::string& name) const { return dir_ + "/" + name; }
  // The empty, private file the cache makes for each fetch.
  std::string Partial(const std::string& name) const {
    const int fd = ::open(Path(name).c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
    if (fd >= 0) ::close(fd);
    return Path(name);
  }
  Status Fetch(HttpFetcher& fetcher, const std::string& url, const std::string& name, int64_t size = -1) {
    return fetcher.Fetch(CacheItem{url, name, size}, Partial(name));
  }
  std::string dir_;
};

TEST_F(HttpFetchTest, WritesBodiesAndKeepsTheConnection) {
  const std::string big(3 << 20, 'x');  // many reads of the body
  TestServer server(Canned({Ok("first"), Ok(big), Ok("")}));
  HttpFetcher fetcher;
  ASSERT_TRUE(Fetch(fetcher, server.Url("/a"), "a", 5).ok());
  ASSERT_TRUE(Fetch(fetcher, server.Url("/b"), "b").ok());
  ASSERT_TRUE(Fetch(fetcher, server.Url("/c"), "c", 0).ok());
  EXPECT_EQ(ReadFile(Path("a")), "first");
  EXPECT_EQ(ReadFile(Path("b")), big);
  EXPECT_EQ(ReadFile(Path("c")), "");
  EXPECT_EQ(fetcher.connections_made(), 1u);
  EXPECT_EQ(server.accepted(), 1);
  EXPECT_NE(server.requests()[0].find("User-Agent: fanrun\r\n"), std::string::npos) << server.requests()[0];
}

TEST_F(HttpFetchTest, FetchesOnSeveralThreadsEachWriteTheirOwnBody) {
  // Each body is one byte repeated, the byte named by the path: a piece of another body shows.
  TestServer echo_server([](TestServer& self, int connection, const std::string& request) {
    const int byte = std::stoi(Target(request).substr(1)) % 256;
    return self.Send(connection, Ok(std::string(static_cast<size_t>(100 + byte), static_cast<char>(byte))));
  });
  HttpFetcher fetcher;
  std::vector<std::thread> threads;
  std::atomic<int> wrong{0};
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([&, t] {
      for (int i = t; i < 2000; i += 8) {
        const std::string name = std::to_string(i);
        if (!Fetch(fetcher, echo_server.Url("/" + name), name).ok() ||
            ReadFile(Path(name)) != std::string(static_cast<size_t>(100 + i % 256), static_cast<char>(i % 256))) {
          ++wrong;
        }
      }
    });
  }
  for (auto& thread : threads) thread.join();
  EXPECT_EQ(wrong.load(), 0);
}

TEST_F(HttpFetchTest, AnErrorStatusNamesItselfAndItsBodyIsNotRead) {
  // A 404 whose body never ends: the error comes at its head, and the connection is dropped.
  TestServer server([](TestServer& self, int connection, const std::string& request) {
    if (Target(request) != "/gone.bin") return Echo(self, connection, request);
    if (!self.Send(connection, "HTTP/1.1 404 Not Found\r\nContent-Length: 100000000000\r\n\r\n")) return false;
    const std::string block(1 << 16, 'n');
    while (self.Send(connection, block)) {
    }
    return false;
  });
  HttpFetcher fetcher;
  const Clock::time_point start = Clock::now();
  Status status = Fetch(fetcher, server.Url("/gone.bin"), "gone");
  EXPECT_LT(SecondsSince(start), 5.0);
  EXPECT_EQ(status.code(), StatusCode::kIOError);
  EXPECT_NE(status.message().find("HTTP 404 Not Found for '" + server.Url("/gone.bin") + "'"), std::string::npos) << status.message();
  EXPECT_EQ(ReadFile(Path("gone")), "");  // nothing of the answer written; the cache removes its file
  ASSERT_TRUE(Fetch(fetcher, server.Url("/after"), "next").ok());
  EXPECT_EQ(ReadFile(Path("next")), "after");
  EXPECT_EQ(server.accepted(), 2);
}

TEST_F(HttpFetchTest, AShortBodyIsDataLoss) {
  TestServer server(Canned({"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabcd"}));
  HttpFetcher fetcher;
  Status status = Fetch(fetcher, server.Url("/short"), "short", 10);
  EXPECT_EQ(status.code(), StatusCode::kDataLoss);
  EXPECT_NE(status.message().find("'" + server.Url("/short") + "' ended after 4 of the 10 bytes"), std::string::npos)
      << status.message();
}

TEST_F(HttpFetchTest, RedirectsAndChunkedBodiesAreFollowedAndRead) {
  TestServer server(Canned({"HTTP/1.1 301 Moved\r\nLocation: /b\r\nContent-Length: 4\r\n\r\nmove",
                            "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n"}));
  HttpFetcher fetcher;
  Status status = Fetch(fetcher, server.Url("/a"), "a");
  ASSERT_TRUE(status.ok()) << status.message();
  EXPECT_EQ(ReadFile(Path("a")), "hello world");
  ASSERT_EQ(server.requests().size(), 2u);
  EXPECT_EQ(Target(server.requests()[1]), "/b");
  EXPECT_TRUE(HttpFetcher::Handles("https://example.org/x"));
  EXPECT_FALSE(HttpFetcher::Handles("s3://bucket/x"));
}

TEST_F(HttpFetchTest, AConnectionTheServerClosedWhileIdleIsReplaced) {
  TestServer server([](TestServer& self, int connection, const std::string& request) {
    Echo(self, connection, request);
    return false;  // closes after each answer, without saying so
  });
  HttpFetcher fetcher;
  ASSERT_TRUE(Fetch(fetcher, server.Url("/one"), "1").ok());
  Status second = Fetch(fetcher, server.Url("/two"), "2");
  ASSERT_TRUE(second.ok()) << second.message();
  EXPECT_EQ(ReadFile(Path("2")), "two");
  EXPECT_EQ(fetcher.connections_made(), 2u);
}

TEST_F(HttpFetchTest, NoServerIsAnErrorNamingTheUrl) {
  int port;
  {
    TestServer closed(Canned({}));  // a port just freed: nothing listens there
    port = closed.port();
  }
  HttpFetcher fetcher;
  const std::string url = "http://127.0.0.1:" + std::to_string(port) + "/x";
  Status status = Fetch(fetcher, url, "x");
  EXPECT_EQ(status.code(), StatusCode::kIOError);
  EXPECT_NE(status.message().find("Failed to fetch '" + url + "'"), std::string::npos) << status.message();
  EXPECT_NE(status.message().find("Failed to connect"), std::string::npos) << status.message();
}

TEST_F(HttpFetchTest, BytesAfterAnAnswerNeverBecomeTheNextFile) {
  // After the first answer, a forged one: read as the answer to the next request on that
  // connection, it would be cached as /ok.
  const std::string forged = "HTTP/1.1 200 OK\r\nContent-Length: 4\r\n\r\nEVIL";
  for (bool same_packet : {false, true}) {
    TestServer server([&](TestServer& self, int connection, const std::string& request) {
      if (Target(request) != "/first") return Echo(self, connection, request);
      if (same_packet) return self.Send(connection, Ok("first") + forged);
      return self.Send(connection, Ok("first")) && self.Pause(50) && self.Send(connection, forged);
    });
    HttpFetcher fetcher;
    ASSERT_TRUE(Fetch(fetcher, server.Url("/first"), "first").ok());
    std::this_thread::sleep_for(std::chrono::milliseconds(300));  // the forged answer has come
    ASSERT_TRUE(Fetch(fetcher, server.Url("/ok"), "ok").ok());
    EXPECT_EQ(ReadFile(Path("first")), "first");
    EXPECT_EQ(ReadFile(Path("ok")), "ok") << "same packet: " << same_packet;
    EXPECT_EQ(server.accepted(), 2);
  }
}

TEST_F(HttpFetchTest, ALengthThatIsNotOnePlainNumberIsAnError) {
  const std::vector<std::pair<std::string, std::string>> heads = {
      {"Content-Length: 3xyz\r\n", "gives a Content-Length of '3xyz', which is not one number of bytes"},
      {"Content-Length: 3, 6\r\n", "gives a Content-Length of '3, 6', which is not one number of bytes"},
      {"Content-Length: 3\r\nContent-Length: 6\r\n", "gives Content-Length twice ('3' and '6')"},
  };
  for (const auto& [fields, expected] : heads) {
    TestServer server([&](TestServer& self, int connection, const std::string& request) {
      if (Target(request) != "/bad") return Echo(self, connection, request);
      return self.Send(connection, "HTTP/1.1 200 OK\r\n" + fields + "\r\nabcdefgh");
    });
    HttpFetcher fetcher;
    Status status = Fetch(fetcher, server.Url("/bad"), "bad");
    EXPECT_EQ(status.code(), StatusCode::kIOError);
    EXPECT_NE(status.message().find("The answer for '" + server.Url("/bad") + "' " + expected), std::string::npos)
        << status.message();
    EXPECT_EQ(ReadFile(Path("bad")), "");  // nothing of the answer written; the cache removes its file
    ASSERT_TRUE(Fetch(fetcher, server.Url("/good"), "good").ok());
    EXPECT_EQ(ReadFile(Path("good")), "good");
    EXPECT_EQ(server.accepted(), 2);  // the refused answer's connection was not used again
  }
}

TEST_F(HttpFetchTest, PathsArePercentEncodedAndControlCharactersRefused) {
  TestServer server(Echo);
  HttpFetcher fetcher;
  ASSERT_TRUE(Fetch(fetcher, server.Url("/index2/sp ace.bin"), "space").ok());
  EXPECT_EQ(ReadFile(Path("space")), "index2/sp%20ace.bin");
  Status injected = Fetch(fetcher, server.Url("/a.bin\r\nX-Injected: 1"), "injected");
  EXPECT_EQ(injected.code(), StatusCode::kInvalid);
  EXPECT_NE(injected.message().find("'" + server.Url("/a.bin\\x0d\\x0aX-Injected: 1") + "' holds a control character"),
            std::string::npos)
      << injected.message();
  const std::vector<std::string> requests = server.requests();
  ASSERT_EQ(requests.size(), 1u);
  EXPECT_EQ(requests[0].find("X-Injected"), std::string::npos);
}

// A head that announces 100 bytes and then a byte of body a second, for as long as the test
// lasts; with a slow head, the head too comes a byte a second.
TestServer::Answer Slow(bool slow_head) {
  return [slow_head](TestServer& server, int connection, const std::string&) {
    const std::string head = "HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n";
    if (!slow_head && !server.Send(connection, head)) return false;
    for (size_t sent = 0; slow_head && sent < head.size(); ++sent) {
      if (!server.Send(connection, head.substr(sent, 1)) || !server.Pause(1000)) return false;
    }
    while (server.Send(connection, "x") && server.Pause(1000)) {
    }
    return false;
  };
}

TEST_F(HttpFetchTest, ASlowHeadOrBodyMeetsTheDeadline) {
  for (bool slow_head : {true, false}) {
    TestServer server(Slow(slow_head));
    HttpOptions options;
    options.timeout_ms = 1500;
    HttpFetcher fetcher(options);
    const Clock::time_point start = Clock::now();
    Status status = Fetch(fetcher, server.Url("/slow"), "slow");
    const double took = SecondsSince(start);
    EXPECT_GT(took, 1.4);
    EXPECT_LT(took, 4.0);
    EXPECT_NE(status.message().find("'" + server.Url("/slow") + "' was not fetched within its deadline of 1.5 s"), std::string::npos)
        << status.message();
    EXPECT_NE(status.message().find("fetch_timeout"), std::string::npos);
  }
}

TEST_F(HttpFetchTest, ASlowHeadOrBodyFailsTheMinimumRate) {
  for (bool slow_head : {true, false}) {
    TestServer server(Slow(slow_head));
    HttpOptions options;
    options.min_rate_bytes = 100;
    options.min_rate_seconds = 1;
    HttpFetcher fetcher(options);
    const Clock::time_point start = Clock::now();
    Status status = Fetch(fetcher, server.Url("/slow"), "slow");
    EXPECT_LT(SecondsSince(start), 4.0);
    EXPECT_NE(status.message().find("'" + server.Url("/slow") + "' came at less than 100 bytes/s for 1 s"), std::string::npos)
        << status.message();
    EXPECT_NE(status.message().find("min_fetch_rate"), std::string::npos);
  }
}

// A chunked body that never ends.
bool Endless(TestServer& server, int connection, const std::string&) {
  if (!server.Send(connection, "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")) return false;
  const std::string chunk = "10000\r\n" + std::string(0x10000, 'e') + "\r\n";
  while (server.Send(connection, chunk)) {
  }
  return false;
}

TEST_F(HttpFetchTest, AnEndlessBodyStopsAtTheListedSizeOrTheLimit) {
  {
    TestServer server(Endless);
    HttpFetcher fetcher;
    Status status = Fetch(fetcher, server.Url("/endless"), "listed", 1000000);
    EXPECT_NE(status.message().find("'" + server.Url("/endless") + "' sent more than the 1000000 bytes its listing gave"),
              std::string::npos)
        << status.message();
  }
  TestServer server(Endless);
  HttpOptions options;
  options.max_bytes = 2000000;
  HttpFetcher fetcher(options);
  Status status = Fetch(fetcher, server.Url("/endless"), "limited");
  EXPECT_NE(status.message().find("'" + server.Url("/endless") + "' is larger than the cache's limit of 2000000 bytes"),
            std::string::npos)
      << status.message();
  EXPECT_LT(server.bytes_sent(), 64u << 20);  // what the socket buffers hold, not more
}

TEST_F(HttpFetchTest, ALengthOtherThanTheListedOneOrOverTheLimitIsRefusedAtTheHead) {
  TestServer server(Echo);
  HttpOptions options;
  options.max_bytes = 3;
  HttpFetcher fetcher(options);
  Status status = Fetch(fetcher, server.Url("/abc"), "abc", 5);
  EXPECT_NE(status.message().find("announces 3 bytes where its listing gave 5"), std::string::npos) << status.message();
  status = Fetch(fetcher, server.Url("/abcd"), "abcd");
  EXPECT_NE(status.message().find("is larger than the cache's limit of 3 bytes"), std::string::npos) << status.message();
  EXPECT_EQ(ReadFile(Path("abcd")), "");  // nothing of the answer written; the cache removes its file
}

TEST_F(HttpFetchTest, AnInterruptEndsAFetchThatWaitsOnAServer) {
  TestServer server(Slow(false));
  HttpFetcher fetcher;
  const Clock::time_point start = Clock::now();
  std::atomic<int> asked{0};
  Interrupt interrupt = [&]() -> Status {
    ++asked;
    return SecondsSince(start) > 0.5 ? Status::Invalid("stop") : Status::OK();
  };
  Status status = fetcher.Fetch(CacheItem{server.Url("/slow"), "slow", -1}, Partial("slow"), interrupt);
  EXPECT_LT(SecondsSince(start), 0.5 + 3 * kInterruptCheckMs / 1000.0);
  EXPECT_EQ(status.message(), "stop");
  EXPECT_GE(asked.load(), 3);
}

}  // namespace
}  // namespace fanrun
