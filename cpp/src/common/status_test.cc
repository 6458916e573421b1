// Tests of Status and Result.
#include "fanrun/status.h"

#include <gtest/gtest.h>

namespace fanrun {
namespace {

Result<int> Half(int x) {
  if (x % 2 != 0) return Status::Invalid("cannot halve ", x);
  return x / 2;
}

Result<int> Quarter(int x) {
  FANRUN_ASSIGN_OR_RETURN(int half, Half(x));
  return Half(half);
}

TEST(StatusTest, OkAndErrors) {
  EXPECT_TRUE(Status::OK().ok());
  Status st = Status::Invalid("bad value ", 3);
  EXPECT_FALSE(st.ok());
  EXPECT_EQ(st.code(), StatusCode::kInvalid);
  EXPECT_EQ(st.message(), "bad value 3");
  EXPECT_EQ(st.ToString(), "Invalid: bad value 3");
}

TEST(StatusTest, ErrnoMessageNamesTheCause) {
  Status st = Status::IOErrorFromErrno(ENOENT, "Failed to open '", "/x", "'");
  EXPECT_EQ(st.code(), StatusCode::kIOError);
  EXPECT_NE(st.message().find("Failed to open '/x'"), std::string::npos);
  EXPECT_NE(st.message().find("No such file or directory"), std::string::npos);
  EXPECT_EQ(st.errnum(), ENOENT);
  const Status retold = st.WithMessage("Cannot use '/x': " + st.message());
  EXPECT_EQ(retold.code(), StatusCode::kIOError);
  EXPECT_EQ(retold.errnum(), ENOENT);
  EXPECT_EQ(Status::IOError("no call failed").errnum(), 0);
}

TEST(ResultTest, PropagatesThroughMacros) {
  auto ok = Quarter(8);
  ASSERT_TRUE(ok.ok());
  EXPECT_EQ(*ok, 2);
  auto bad = Quarter(6);
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().message(), "cannot halve 3");
}

TEST(ResultTest, OkStatusWithoutValueIsAnInternalError) {
  Result<int> r = Status::OK();
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInternal);
}

}  // namespace
}  // namespace fanrun
