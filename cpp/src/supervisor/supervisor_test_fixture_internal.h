// The fixture of the supervisor's tests (supervisor_test.cc, spare_rank_test.cc): a private
// directory, ranks that run shell scripts, and a pump that runs a supervisor to its end.
#pragma once

#include <gtest/gtest.h>

#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "fanrun/supervisor.h"
#include "common/test_util_internal.h"

namespace fanrun::testing {

class SupervisorFixture : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = MakeTempDir("fanrun-supervisor-test");
    ASSERT_FALSE(dir_.empty());
  }
  void TearDown() override { ASSERT_TRUE(RemoveTree(dir_)); }

  // Rank i runs scripts[i] with RANK=i, logging to rank_i.log in the directory.
  SupervisorOptions Options(const std::vector<std::string>& scripts) {
    SupervisorOptions options;
    for (size_t i = 0; i < scripts.size(); ++i) {
      RankOptions rank;
      rank.spawn.argv = ShellCommand(scripts[i]);
      rank.spawn.env = MinimalEnv();
      rank.spawn.env.push_back("RANK=" + std::to_string(i));
      rank.log_path = dir_ + "/rank_" + std::to_string(i) + ".log";
      options.ranks.push_back(rank);
    }
    options.keeper_path = KeeperPath();
    options.kill_grace_s = 0.5;
    return options;
  }

  // Pumps the supervisor until every rank is reaped.
  static std::vector<Event> RunToEnd(Supervisor& supervisor) {
    std::vector<Event> all;
    for (;;) {
      auto batch = supervisor.Wait();
      EXPECT_TRUE(batch.ok()) << batch.status().message();
      if (!batch.ok()) return all;
      for (auto& event : batch->events) all.push_back(std::move(event));
      if (batch->done) return all;
    }
  }

  static std::map<int, std::string> Lines(const std::vector<Event>& events, Stream stream) {
    std::map<int, std::string> out;
    for (const auto& e : events) {
      if (e.kind == EventKind::kOutput && e.stream == stream) out[e.rank] += e.text + "|";
    }
    return out;
  }

  static std::string ReadFile(const std::string& path) {
    std::ifstream in(path, std::ios::binary);
    std::stringstream text;
    text << in.rdbuf();
    return text.str();
  }

  std::string dir_;
};

}  // namespace fanrun::testing
