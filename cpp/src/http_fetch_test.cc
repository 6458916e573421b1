#include "fanrun/http_fetch.h"

#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "test_util_internal.h"

namespace fanrun {
namespace {

// A real HTTP server on 127.0.0.1 for one test: answers the requests of each connection with
// the next canned answers, and closes a connection after `answers_per_connection` of them.
class CannedServer {
 public:
  CannedServer(std::vector<std::string> answers, size_t answers_per_connection)
      : answers_(std::move(answers)), per_connection_(answers_per_connection) {
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
  ~CannedServer() {
    ::shutdown(listener_, SHUT_RDWR);
    thread_.join();
    ::close(listener_);
  }
  std::string Url(const std::string& path) const { return "http://127.0.0.1:" + std::to_string(port_) + path; }
  int accepted() const { return accepted_.load(); }

 private:
  void Serve() {
    size_t next = 0;
    while (next < answers_.size()) {
      const int connection = ::accept4(listener_, nullptr, nullptr, SOCK_CLOEXEC);
      if (connection < 0) return;
      ++accepted_;
      for (size_t served = 0; served < per_connection_ && next < answers_.size(); ++served) {
        std::string request;
        char buffer[4096];
        while (request.find("\r\n\r\n") == std::string::npos) {
          const ssize_t n = ::recv(connection, buffer, sizeof(buffer), 0);
          if (n <= 0) break;
          request.append(buffer, static_cast<size_t>(n));
        }
        if (request.find("\r\n\r\n") == std::string::npos) break;
        const std::string& answer = answers_[next++];
        (void)::send(connection, answer.data(), answer.size(), MSG_NOSIGNAL);
      }
      ::close(connection);
    }
  }

  std::vector<std::string> answers_;
  size_t per_connection_;
  int listener_ = -1;
  int port_ = 0;
  std::atomic<int> accepted_{0};
  std::thread thread_;
};

std::string Ok(const std::string& body) {
  return "HTTP/1.1 200 OK\r\nContent-Length: " + std::to_string(body.size()) + "\r\n\r\n" + body;
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
  std::string dir_;
};

TEST(HttpUrlTest, PlainHttpOnly) {
  HttpUrl url;
  ASSERT_TRUE(ParseHttpUrl("http://127.0.0.1:8080/data/a%20b.bin?x=1#frag", &url));
  EXPECT_EQ(url.host, "127.0.0.1");
  EXPECT_EQ(url.port, "8080");
  EXPECT_EQ(url.target, "/data/a%20b.bin?x=1");
  ASSERT_TRUE(ParseHttpUrl("HTTP://example.org", &url));
  EXPECT_EQ(url.port, "80");
  EXPECT_EQ(url.target, "/");
  EXPECT_FALSE(ParseHttpUrl("https://example.org/a", &url));
  EXPECT_FALSE(ParseHttpUrl("http://user:secret@example.org/a", &url));
  EXPECT_FALSE(ParseHttpUrl("http://example.org:http/a", &url));
  EXPECT_FALSE(ParseHttpUrl("s3://bucket/a", &url));
}

TEST_F(HttpFetchTest, WritesBodiesAndKeepsTheConnection) {
  const std::string big(3 << 20, 'x');  // several reads of the body
  CannedServer server({Ok("first"), Ok(big), Ok("")}, 3);
  HttpFetcher fetcher;
  bool fall_back = true;
  ASSERT_TRUE(fetcher.Fetch(CacheItem{server.Url("/a"), "a", 5}, Path("a"), &fall_back).ok());
  EXPECT_FALSE(fall_back);
  ASSERT_TRUE(fetcher.Fetch(CacheItem{server.Url("/b"), "b", -1}, Path("b"), &fall_back).ok());
  ASSERT_TRUE(fetcher.Fetch(CacheItem{server.Url("/c"), "c", 0}, Path("c"), &fall_back).ok());
  EXPECT_EQ(ReadFile(Path("a")), "first");
  EXPECT_EQ(ReadFile(Path("b")), big);
  EXPECT_EQ(ReadFile(Path("c")), "");
  EXPECT_EQ(fetcher.connections_made(), 1u);
  EXPECT_EQ(server.accepted(), 1);
}

TEST_F(HttpFetchTest, AnErrorStatusNamesItselfAndTheUrlAndKeepsTheConnection) {
  CannedServer server({"HTTP/1.1 404 Not Found\r\nContent-Length: 9\r\n\r\nnot found", Ok("after")}, 2);
  HttpFetcher fetcher;
  bool fall_back = false;
  Status status = fetcher.Fetch(CacheItem{server.Url("/gone.bin"), "gone", -1}, Path("gone"), &fall_back);
  EXPECT_EQ(status.code(), StatusCode::kIOError);
  EXPECT_NE(status.message().find("HTTP 404 Not Found for '" + server.Url("/gone.bin") + "'"), std::string::npos) << status.message();
  EXPECT_TRUE(fetcher.Fetch(CacheItem{server.Url("/next"), "next", -1}, Path("next"), &fall_back).ok());
  EXPECT_EQ(ReadFile(Path("next")), "after");
  EXPECT_EQ(server.accepted(), 1);
}

TEST_F(HttpFetchTest, AShortBodyIsDataLoss) {
  CannedServer server({"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabcd"}, 1);
  HttpFetcher fetcher;
  bool fall_back = false;
  Status status = fetcher.Fetch(CacheItem{server.Url("/short"), "short", 10}, Path("short"), &fall_back);
  EXPECT_EQ(status.code(), StatusCode::kDataLoss);
  EXPECT_NE(status.message().find("ended after 4 of the 10 bytes"), std::string::npos) << status.message();
}

TEST_F(HttpFetchTest, RedirectsAndChunkedBodiesAreLeftToAnotherFetcher) {
  CannedServer server({"HTTP/1.1 301 Moved\r\nLocation: /b\r\nContent-Length: 0\r\n\r\n",
                       "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n"}, 1);
  HttpFetcher fetcher;
  bool fall_back = false;
  EXPECT_TRUE(fetcher.Fetch(CacheItem{server.Url("/a"), "a", -1}, Path("a"), &fall_back).ok());
  EXPECT_TRUE(fall_back);
  fall_back = false;
  EXPECT_TRUE(fetcher.Fetch(CacheItem{server.Url("/c"), "c", -1}, Path("c"), &fall_back).ok());
  EXPECT_TRUE(fall_back);
  fall_back = false;
  EXPECT_TRUE(fetcher.Fetch(CacheItem{"https://example.org/x", "x", -1}, Path("x"), &fall_back).ok());
  EXPECT_TRUE(fall_back);
}

TEST_F(HttpFetchTest, AConnectionTheServerClosedWhileIdleIsReplaced) {
  CannedServer server({Ok("one"), Ok("two")}, 1);  // closes after each answer, without saying so
  HttpFetcher fetcher;
  bool fall_back = false;
  ASSERT_TRUE(fetcher.Fetch(CacheItem{server.Url("/1"), "1", -1}, Path("1"), &fall_back).ok());
  Status second = fetcher.Fetch(CacheItem{server.Url("/2"), "2", -1}, Path("2"), &fall_back);
  ASSERT_TRUE(second.ok()) << second.ToString();
  EXPECT_EQ(ReadFile(Path("2")), "two");
  EXPECT_EQ(fetcher.connections_made(), 2u);
}

TEST_F(HttpFetchTest, NoServerIsAnErrorNamingTheAddress) {
  int port;
  {
    CannedServer closed({}, 1);  // a port just freed: nothing listens there
    port = std::stoi(closed.Url("").substr(17));
  }
  HttpFetcher fetcher;
  bool fall_back = false;
  const std::string url = "http://127.0.0.1:" + std::to_string(port) + "/x";
  Status status = fetcher.Fetch(CacheItem{url, "x", -1}, Path("x"), &fall_back);
  EXPECT_EQ(status.code(), StatusCode::kIOError);
  EXPECT_NE(status.message().find("Failed to connect to 127.0.0.1:" + std::to_string(port)), std::string::npos) << status.message();
}

}  // namespace
}  // namespace fanrun
