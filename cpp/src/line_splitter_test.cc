// Tests of cutting output into lines and progress updates.
#include "fanrun/line_splitter.h"

#include <gtest/gtest.h>

#include <utility>
#include <vector>

namespace fanrun {
namespace {

using Segments = std::vector<std::pair<SegmentKind, std::string>>;

Segments Split(const std::vector<std::string>& chunks, size_t max_line = 1024) {
  LineSplitter splitter(max_line);
  Segments out;
  auto sink = [&](SegmentKind kind, std::string_view text) { out.emplace_back(kind, std::string(text)); };
  for (const auto& chunk : chunks) splitter.Feed(chunk, sink);
  splitter.Finish(sink);
  return out;
}

TEST(LineSplitterTest, LinesSurviveAnyChunking) {
  const Segments expected = {{SegmentKind::kLine, "hello"}, {SegmentKind::kLine, "world"}};
  EXPECT_EQ(Split({"hello\nworld\n"}), expected);
  EXPECT_EQ(Split({"hel", "lo\nwor", "ld", "\n"}), expected);
  EXPECT_EQ(Split({"h", "e", "l", "l", "o", "\n", "world\n"}), expected);
}

TEST(LineSplitterTest, CrLfIsANewlineEvenAcrossChunks) {
  const Segments expected = {{SegmentKind::kLine, "a"}, {SegmentKind::kLine, "b"}};
  EXPECT_EQ(Split({"a\r\nb\r\n"}), expected);
  EXPECT_EQ(Split({"a\r", "\nb\r", "\n"}), expected);
}

TEST(LineSplitterTest, UnterminatedLastLineIsKeptAtTheEnd) {
  EXPECT_EQ(Split({"one\ntwo"}), (Segments{{SegmentKind::kLine, "one"}, {SegmentKind::kLine, "two"}}));
}

TEST(LineSplitterTest, ProgressBarShowsItsLatestStatePerChunkThenTheFinalLine) {
  // tqdm writes "\r<bar>" for each update and "\n" when done.
  const Segments got = Split({"\r 10%", "\r 20%\r 30%", "\r100%\n"});
  const Segments expected = {{SegmentKind::kProgress, " 10%"},
                             {SegmentKind::kProgress, " 30%"},
                             {SegmentKind::kLine, "100%"}};
  EXPECT_EQ(got, expected);
}

TEST(LineSplitterTest, PlainPartialLineIsNotProgress) {
  LineSplitter splitter(1024);
  Segments out;
  splitter.Feed("no newline yet", [&](SegmentKind k, std::string_view t) { out.emplace_back(k, std::string(t)); });
  EXPECT_TRUE(out.empty());
}

TEST(LineSplitterTest, VeryLongLineComesInBoundedPieces) {
  const std::string line(10000, 'x');
  const Segments got = Split({line.substr(0, 3333), line.substr(3333) + "\n"}, 4096);
  ASSERT_EQ(got.size(), 3u);
  EXPECT_EQ(got[0], std::make_pair(SegmentKind::kPartial, std::string(4096, 'x')));
  EXPECT_EQ(got[1], std::make_pair(SegmentKind::kPartial, std::string(4096, 'x')));
  EXPECT_EQ(got[2], std::make_pair(SegmentKind::kLine, std::string(10000 - 8192, 'x')));
}

TEST(LineSplitterTest, BinaryBytesPassThroughUntouched) {
  const std::string binary("\x00\x01\xff\xfe", 4);
  const Segments got = Split({binary + "\n"});
  ASSERT_EQ(got.size(), 1u);
  EXPECT_EQ(got[0].second, binary);
}

}  // namespace
}  // namespace fanrun
