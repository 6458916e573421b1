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

TEST(LineSplitterTest, ARedrawnRowPastTheLimitGoesOnAsOneLine) {
  // Read in chunks as a pipe hands them over: each chunk's end would show the redraw so far.
  const Segments got = Split({"\r" + std::string(1000, 'x'), std::string(3000, 'x'), std::string(1000, 'x') + "\n"});
  EXPECT_EQ(got, (Segments{{SegmentKind::kProgress, std::string(1000, 'x')},
                           {SegmentKind::kPartial, std::string(1024, 'x')},
                           {SegmentKind::kPartial, std::string(1024, 'x')},
                           {SegmentKind::kPartial, std::string(1024, 'x')},
                           {SegmentKind::kPartial, std::string(1024, 'x')},
                           {SegmentKind::kLine, std::string(904, 'x')}}));
}

TEST(LineSplitterTest, BinaryBytesPassThroughUntouched) {
  const std::string binary("\x00\x01\xff\xfe", 4);
  const Segments got = Split({binary + "\n"});
  ASSERT_EQ(got.size(), 1u);
  EXPECT_EQ(got[0].second, binary);
}

// Feeds each chunk as one write of the rank, then ends the stream.
class Recorder {
 public:
  Recorder() : splitter_(1024) {}
  Recorder& Feed(std::string_view chunk) {
    splitter_.Feed(chunk, sink_);
    return *this;
  }
  Recorder& ShowHeld() {
    splitter_.ShowHeld(sink_);
    return *this;
  }
  Recorder& Finish() {
    splitter_.Finish(sink_);
    return *this;
  }
  bool HoldsUnshown() const { return splitter_.HoldsUnshown(); }
  const Segments& segments() const { return segments_; }
  Segments Lines() const {
    Segments lines;
    for (const auto& segment : segments_) {
      if (segment.first == SegmentKind::kLine) lines.push_back(segment);
    }
    return lines;
  }

 private:
  LineSplitter splitter_;
  Segments segments_;
  LineSplitter::Sink sink_ = [this](SegmentKind kind, std::string_view text) {
    segments_.emplace_back(kind, std::string(text));
  };
};

TEST(LineSplitterTest, HeldLineIsShownAsPartialAndItsRestGoesOn) {
  Recorder r;
  r.Feed("waiting...");
  EXPECT_TRUE(r.segments().empty());
  EXPECT_TRUE(r.HoldsUnshown());
  r.ShowHeld().ShowHeld();
  EXPECT_EQ(r.segments(), (Segments{{SegmentKind::kPartial, "waiting..."}}));
  EXPECT_FALSE(r.HoldsUnshown());
  r.Feed(" done\nnext\n");
  EXPECT_EQ(r.segments(), (Segments{{SegmentKind::kPartial, "waiting..."},
                                    {SegmentKind::kLine, " done"},
                                    {SegmentKind::kLine, "next"}}));
}

TEST(LineSplitterTest, HeldLineIsEndedByTheEndOfTheStream) {
  Recorder r;
  r.Feed("last words").ShowHeld().Finish();
  EXPECT_EQ(r.segments(), (Segments{{SegmentKind::kPartial, "last words"}, {SegmentKind::kLine, ""}}));
}

TEST(LineSplitterTest, HeldLineBeforeACarriageReturnIsShownAsProgress) {
  // print(f"step {i}", end="\r"): the '\r' comes before the text it redraws.
  Recorder r;
  r.Feed("step 1\r");
  EXPECT_TRUE(r.segments().empty());
  r.ShowHeld().Feed("step 2\r");
  EXPECT_FALSE(r.HoldsUnshown());  // shown as the chunk ended: not shown twice
  r.ShowHeld().Feed("\n");
  EXPECT_EQ(r.segments(), (Segments{{SegmentKind::kProgress, "step 1"},
                                    {SegmentKind::kProgress, "step 2"},
                                    {SegmentKind::kLine, "step 2"}}));
}

TEST(LineSplitterTest, BarDrawnBelowTheCurrentLineLeavesNoLines) {
  // tqdm(position=2), write by write: down two rows, draw, back up two rows.
  Recorder r;
  for (const char* state : {"  0%|", " 50%|#####", "100%|##########"}) {
    r.Feed("\n\n").Feed(std::string("\r") + state).Feed("\x1b[A\x1b[A");
  }
  // Closing with leave=True: the last state drawn on the current row, then a newline.
  r.Feed("").Feed("\r100%|##########").Feed("\n");
  EXPECT_TRUE(r.HoldsUnshown());  // the final line waits for a cursor-up that does not come
  r.ShowHeld().Finish();
  // Only the first descent, before the stream was seen moving the cursor up, leaves rows.
  EXPECT_EQ(r.Lines(), (Segments{{SegmentKind::kLine, ""}, {SegmentKind::kLine, ""},
                                 {SegmentKind::kLine, "100%|##########"}}));
  EXPECT_EQ(r.segments()[2], std::make_pair(SegmentKind::kProgress, std::string("  0%|")));
  EXPECT_EQ(r.segments()[4], std::make_pair(SegmentKind::kProgress, std::string("100%|##########")));
}

TEST(LineSplitterTest, NestedBarsLeaveTheOuterBarsLines) {
  // tqdm's outer bar on the current row, an inner bar (leave=False) on the row below.
  Recorder r;
  r.Feed("\r  0%| 0/2");
  for (const char* outer : {" 50%| 1/2", "100%| 2/2"}) {
    for (const char* inner : {"  0%| 0/3", " 50%| 1/3", "100%| 3/3"}) {
      r.Feed("\n").Feed(std::string("\r") + inner).Feed("\x1b[A");
    }
    r.Feed("\n").Feed("\r          ").Feed("\x1b[A");  // the inner bar erased
    r.Feed(std::string("\r") + outer);
  }
  r.Feed("\n").Finish();
  // One line for the outer bar as the first inner bar pushed it up, one for its end.
  EXPECT_EQ(r.Lines(), (Segments{{SegmentKind::kLine, "  0%| 0/2"}, {SegmentKind::kLine, "100%| 2/2"}}));
}

TEST(LineSplitterTest, CursorUpIsReadAcrossChunksAndWithACountWhileOtherEscapesStayText) {
  Recorder r;
  r.Feed("\x1b[1A").Feed("\n\n\n\r bar\x1b").Feed("[").Feed("3").Feed("A").Feed("\r 2\x1b[3A");
  EXPECT_EQ(r.segments(), (Segments{{SegmentKind::kProgress, " bar"}, {SegmentKind::kProgress, " 2"}}));
  // Colours, erasures and what merely starts like an escape are the text's own.
  r.Feed("\x1b[31mred\x1b[0m \x1b").Feed("M\x1b[2K|\x1b[").Feed("5\n").Feed("x\x1b[").Finish();
  EXPECT_EQ(r.Lines(), (Segments{{SegmentKind::kLine, "\x1b[31mred\x1b[0m \x1bM\x1b[2K|\x1b[5"},
                                 {SegmentKind::kLine, "x\x1b["}}));
}

}  // namespace
}  // namespace fanrun
