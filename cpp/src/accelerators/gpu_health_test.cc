// Tests of the health gate's NVML reader against recorded answers (recorded_nvml.c).
#include "fanrun/gpu_health.h"

#include <gtest/gtest.h>
#include <stdlib.h>
#include <unistd.h>

#include <fstream>
#include <string>

namespace fanrun {
namespace {

// Writes the answers to a file of this test's own and points the stand-in NVML at it.
class RecordedNvml : public ::testing::Test {
 protected:
  void Record(const std::string& answers) {
    path_ = ::testing::TempDir() + "recorded_nvml_" + std::to_string(::getpid()) + ".txt";
    std::ofstream(path_) << answers;
    ::setenv("FANRUN_RECORDED_NVML", path_.c_str(), 1);
  }
  void TearDown() override {
    ::unsetenv("FANRUN_RECORDED_NVML");
    if (!path_.empty()) ::unlink(path_.c_str());
  }
  std::string path_;
};

TEST_F(RecordedNvml, ReadsEveryAnswerOfEveryGpu) {
  Record(
      "driver 550.54.15\n"
      "gpu 0\nname NVIDIA H200\nuuid GPU-aaaa\nmemory 1000 10\necc_uncorrected 0\nretired_pages_pending 0\n"
      "remapped_rows 0 0 0 0\nthrottle_reasons 0x1\npcie 5 5 16 16\nutilization 0\n"
      "gpu 1\nname NVIDIA H200\nuuid GPU-bbbb\nmemory 1000 600\necc_uncorrected 3\nremapped_rows 0 1 1 1\n"
      "throttle_reasons 0x48\npcie 3 5 8 16\nutilization 97\nprocess 4242 500\nprocess 4343 90\n");
  Result<std::unique_ptr<GpuHealthReader>> reader = GpuHealthReader::Open(FANRUN_TEST_RECORDED_NVML);
  ASSERT_TRUE(reader.ok()) << reader.status().message();
  EXPECT_EQ((*reader)->Count(), 2u);
  for (int round = 0; round < 2; ++round) {  // NVML stays open between readings
    Result<std::vector<GpuHealthReading>> readings = (*reader)->Read({1, 0});
    ASSERT_TRUE(readings.ok()) << readings.status().message();
    ASSERT_EQ(readings->size(), 2u);
    const GpuHealthReading& bad = (*readings)[0];
    EXPECT_EQ(bad.nvml_index, 1);
    EXPECT_EQ(bad.uuid, "GPU-bbbb");
    EXPECT_EQ(bad.ecc_uncorrected_volatile, 3u);
    EXPECT_FALSE(bad.retired_pages_pending.has_value());  // not recorded: not supported
    EXPECT_EQ(bad.remapped_rows_pending, true);
    EXPECT_EQ(bad.remapped_rows_failure, true);
    EXPECT_EQ(bad.throttle_reasons, 0x48u);
    EXPECT_EQ(bad.pcie_generation, 3u);
    EXPECT_EQ(bad.pcie_generation_max, 5u);
    EXPECT_EQ(bad.pcie_width, 8u);
    EXPECT_EQ(bad.pcie_width_max, 16u);
    EXPECT_EQ(bad.utilization_percent, 97u);
    EXPECT_EQ(bad.memory_used, 600u);
    ASSERT_TRUE(bad.compute_processes.has_value());
    ASSERT_EQ(bad.compute_processes->size(), 2u);
    EXPECT_EQ((*bad.compute_processes)[1].pid, 4343u);
    EXPECT_EQ((*bad.compute_processes)[1].used_memory, 90u);
    const GpuHealthReading& good = (*readings)[1];
    EXPECT_EQ(good.ecc_uncorrected_volatile, 0u);
    EXPECT_EQ(good.retired_pages_pending, false);
    ASSERT_TRUE(good.compute_processes.has_value());
    EXPECT_TRUE(good.compute_processes->empty());
  }
}

TEST_F(RecordedNvml, AnswersNotRecordedAreAbsentNotZero) {
  Record("gpu 0\nname NVIDIA A10\nuuid GPU-cccc\n");
  Result<std::unique_ptr<GpuHealthReader>> reader = GpuHealthReader::Open(FANRUN_TEST_RECORDED_NVML);
  ASSERT_TRUE(reader.ok()) << reader.status().message();
  Result<std::vector<GpuHealthReading>> readings = (*reader)->Read({0});
  ASSERT_TRUE(readings.ok());
  const GpuHealthReading& reading = (*readings)[0];
  EXPECT_FALSE(reading.ecc_uncorrected_volatile.has_value());
  EXPECT_FALSE(reading.remapped_rows_pending.has_value());
  EXPECT_FALSE(reading.throttle_reasons.has_value());
  EXPECT_FALSE(reading.pcie_width.has_value());
  EXPECT_FALSE(reading.memory_total.has_value());
}

TEST_F(RecordedNvml, AnIndexTheDriverDoesNotHaveIsInvalid) {
  Record("gpu 0\nuuid GPU-dddd\n");
  Result<std::unique_ptr<GpuHealthReader>> reader = GpuHealthReader::Open(FANRUN_TEST_RECORDED_NVML);
  ASSERT_TRUE(reader.ok());
  Result<std::vector<GpuHealthReading>> readings = (*reader)->Read({0, 7});
  ASSERT_FALSE(readings.ok());
  EXPECT_EQ(readings.status().code(), StatusCode::kInvalid);
  EXPECT_NE(readings.status().message().find("GPU 7 does not exist: NVML reports 1 GPUs"), std::string::npos);
}

TEST(GpuHealthReaderTest, MissingDriverIsNotFound) {
  Result<std::unique_ptr<GpuHealthReader>> reader = GpuHealthReader::Open("libfanrun-no-such-nvml.so");
  ASSERT_FALSE(reader.ok());
  EXPECT_EQ(reader.status().code(), StatusCode::kNotFound);
}

TEST(GpuHealthReaderTest, NvmlThatDoesNotInitialiseIsInternal) {
  ::unsetenv("FANRUN_RECORDED_NVML");  // the stand-in then fails to start, as NVML without a driver
  Result<std::unique_ptr<GpuHealthReader>> reader = GpuHealthReader::Open(FANRUN_TEST_RECORDED_NVML);
  ASSERT_FALSE(reader.ok());
  EXPECT_EQ(reader.status().code(), StatusCode::kInternal);
  EXPECT_NE(reader.status().message().find("failed to initialise"), std::string::npos);
}

}  // namespace
}  // namespace fanrun
