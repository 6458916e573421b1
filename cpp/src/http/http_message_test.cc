#include "http/http_message_internal.h"

#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>

namespace fanrun::internal {
namespace {

std::string Requested(const std::string& url) {
  Result<std::string> requested = RequestUrl(url);
  EXPECT_TRUE(requested.ok()) << requested.status().message();
  return requested.ok() ? *requested : "";
}

TEST(RequestUrlTest, EncodesWhatAPathMayNotHoldAndKeepsWhatItMay) {
  EXPECT_EQ(Requested("http://127.0.0.1:8080/index2/sp ace.bin"), "http://127.0.0.1:8080/index2/sp%20ace.bin");
  EXPECT_EQ(Requested("http://h/a%20b.bin?x=1&y=a:b@c#frag"), "http://h/a%20b.bin?x=1&y=a:b@c");
  EXPECT_EQ(Requested("https://h/caf\xc3\xa9/\"q\"<>{}|\\^`[]"),
            "https://h/caf%C3%A9/%22q%22%3C%3E%7B%7D%7C%5C%5E%60%5B%5D");
  EXPECT_EQ(Requested("http://h/100%/50%zz/%4"), "http://h/100%25/50%25zz/%254");  // a '%' that starts no escape
  EXPECT_EQ(Requested("HTTP://h"), "HTTP://h/");
  EXPECT_EQ(Requested("http://h?q"), "http://h/?q");
  EXPECT_EQ(Requested("http://h/~a-b_c.d/!$&'()*+,;=:@"), "http://h/~a-b_c.d/!$&'()*+,;=:@");
}

TEST(RequestUrlTest, RefusesControlCharactersNamingTheUrl) {
  for (const std::string& url : std::vector<std::string>{"http://h/a\r\nX-Injected: 1", "http://h/a\nb", std::string("http://h/a\0b", 12),
                                "http://h/a\x7f", "http://h\r\n/a", "http://h/a#\x1b[2J"}) {
    Result<std::string> requested = RequestUrl(url);
    ASSERT_FALSE(requested.ok()) << url;
    EXPECT_EQ(requested.status().code(), StatusCode::kInvalid);
    EXPECT_NE(requested.status().message().find("holds a control character"), std::string::npos);
    EXPECT_EQ(requested.status().message().find_first_of("\r\n\x1b\x7f"), std::string::npos) << requested.status().message();
  }
  Result<std::string> injected = RequestUrl("http://h/a\r\nX-Injected: 1");
  EXPECT_NE(injected.status().message().find("'http://h/a\\x0d\\x0aX-Injected: 1'"), std::string::npos)
      << injected.status().message();
}

TEST(RequestUrlTest, RefusesWhatIsNotAnHttpUrlWithAHost) {
  EXPECT_FALSE(RequestUrl("ftp://h/a").ok());
  EXPECT_FALSE(RequestUrl("http:///a").ok());
  EXPECT_FALSE(RequestUrl("http://").ok());
  EXPECT_TRUE(IsHttpUrl("HTTPS://h/a"));
  EXPECT_FALSE(IsHttpUrl("s3://bucket/a"));
  EXPECT_FALSE(IsHttpUrl("/data/http://x"));
}

Status Feed(ResponseHead* head, std::initializer_list<const char*> lines) {
  for (const char* line : lines) {
    FANRUN_RETURN_NOT_OK(head->AddLine(line));
  }
  return Status::OK();
}

TEST(ResponseHeadTest, ReadsTheStatusTheReasonAndTheLength) {
  ResponseHead head;
  ASSERT_TRUE(Feed(&head, {"HTTP/1.1 404 Not Found\r\n", "content-length:  12 \r\n", "Server: x\r\n"}).ok());
  EXPECT_FALSE(head.complete());
  ASSERT_TRUE(head.AddLine("\r\n").ok());
  EXPECT_TRUE(head.complete());
  EXPECT_EQ(head.status(), 404);
  EXPECT_EQ(head.reason(), "Not Found");
  EXPECT_EQ(head.content_length(), 12);

  ResponseHead http2;
  ASSERT_TRUE(Feed(&http2, {"HTTP/2 200 \r\n", "\r\n"}).ok());
  EXPECT_EQ(http2.status(), 200);
  EXPECT_EQ(http2.reason(), "");
  EXPECT_EQ(http2.content_length(), -1);
}

TEST(ResponseHeadTest, AStatusLineStartsAFreshHead) {
  ResponseHead head;
  ASSERT_TRUE(Feed(&head, {"HTTP/1.1 301 Moved\r\n", "Location: /b\r\n", "Content-Length: 5\r\n", "\r\n"}).ok());
  EXPECT_TRUE(head.has_location());
  ASSERT_TRUE(Feed(&head, {"HTTP/1.1 200 OK\r\n", "Content-Length: 7\r\n", "\r\n"}).ok());
  EXPECT_EQ(head.status(), 200);
  EXPECT_FALSE(head.has_location());
  EXPECT_EQ(head.content_length(), 7);
  ASSERT_TRUE(head.AddLine("Content-Length: 99\r\n").ok());  // a chunked body's trailer frames nothing
  EXPECT_EQ(head.content_length(), 7);
}

TEST(ResponseHeadTest, RefusesALengthThatIsNotOnePlainNumber) {
  for (const char* value : {"3xyz", "3, 6", "-3", "+3", "", "0x10", "3 6", "1234567890123456789"}) {
    ResponseHead head;
    ASSERT_TRUE(head.AddLine("HTTP/1.1 200 OK\r\n").ok());
    Status added = head.AddLine(std::string("Content-Length: ") + value + "\r\n");
    EXPECT_FALSE(added.ok()) << value;
    EXPECT_NE(added.message().find("which is not one number of bytes"), std::string::npos) << added.message();
  }
}

TEST(ResponseHeadTest, RefusesAnAmbiguousEnd) {
  ResponseHead twice;
  Status added = Feed(&twice, {"HTTP/1.1 200 OK\r\n", "Content-Length: 3\r\n", "Content-length: 6\r\n"});
  EXPECT_NE(added.message().find("gives Content-Length twice ('3' and '6')"), std::string::npos) << added.message();
  ResponseHead same_twice;
  EXPECT_FALSE(Feed(&same_twice, {"HTTP/1.1 200 OK\r\n", "Content-Length: 3\r\n", "Content-Length: 3\r\n"}).ok());
  ResponseHead both;
  added = Feed(&both, {"HTTP/1.1 200 OK\r\n", "Transfer-Encoding: chunked\r\n", "Content-Length: 3\r\n", "\r\n"});
  EXPECT_NE(added.message().find("both Content-Length and Transfer-Encoding"), std::string::npos) << added.message();
  ResponseHead folded;
  added = Feed(&folded, {"HTTP/1.1 200 OK\r\n", "Content-Length: 3\r\n", " 6\r\n"});
  EXPECT_NE(added.message().find("folded line"), std::string::npos) << added.message();
  ResponseHead spaced;
  EXPECT_FALSE(Feed(&spaced, {"HTTP/1.1 200 OK\r\n", "Content-Length : 3\r\n"}).ok());
  ResponseHead no_status;
  EXPECT_FALSE(Feed(&no_status, {"Content-Length: 3\r\n"}).ok());
  ResponseHead bad_status;
  EXPECT_FALSE(Feed(&bad_status, {"HTTP/1.1 2x0 OK\r\n"}).ok());
}

// Every line a server could send, as random bytes: no read past what was given (ASan
// watches), and what is accepted keeps the head's invariants.
TEST(ResponseHeadTest, RandomLinesAreReadSafely) {
  std::mt19937 random(15);
  const char letters[] = "HTP/1. 0123456789:-CcontentLlgh\r\n\t,xX\x00\xff";
  const std::string alphabet(letters, sizeof(letters) - 1);
  for (int round = 0; round < 20000; ++round) {
    ResponseHead head;
    (void)head.AddLine(round % 2 == 0 ? "HTTP/1.1 200 OK\r\n" : "");
    for (int line = 0; line < 4; ++line) {
      std::string text(random() % 24, '\0');
      for (char& c : text) c = alphabet[random() % alphabet.size()];
      if (round % 3 == 0) text = "Content-Length:" + text;
      Status added = head.AddLine(text);
      if (!added.ok()) break;
      EXPECT_GE(head.content_length(), -1);
    }
    std::string url = "http://h/";
    for (int i = 0; i < 16; ++i) url += static_cast<char>(random() % 256);
    Result<std::string> requested = RequestUrl(url);
    if (requested.ok()) {
      for (char c : *requested) EXPECT_GT(static_cast<unsigned char>(c), 0x20);
    }
  }
}

}  // namespace
}  // namespace fanrun::internal
