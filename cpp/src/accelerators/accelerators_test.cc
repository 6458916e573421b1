// Tests of GPU detection without a GPU and of CUDA_VISIBLE_DEVICES' rules.
#include "fanrun/accelerators.h"

#include <gtest/gtest.h>

namespace fanrun {
namespace {

std::vector<GpuInfo> FourGpus() {
  std::vector<GpuInfo> gpus;
  for (int i = 0; i < 4; ++i) {
    GpuInfo gpu;
    gpu.nvml_index = i;
    gpu.name = "NVIDIA H200";
    gpu.uuid = "GPU-" + std::to_string(i) + "aaaa-" + std::to_string(i);
    gpus.push_back(gpu);
  }
  return gpus;
}

std::vector<int> Indices(const std::vector<GpuInfo>& gpus) {
  std::vector<int> out;
  for (const auto& gpu : gpus) out.push_back(gpu.nvml_index);
  return out;
}

TEST(DetectGpusTest, MissingDriverIsAnEmptyInventoryWithAReason) {
  GpuInventory inventory = DetectGpus("libfanrun-no-such-nvml.so");
  EXPECT_TRUE(inventory.gpus.empty());
  EXPECT_NE(inventory.note.find("could not be loaded"), std::string::npos);
}

TEST(GpuSamplerTest, MissingDriverIsNotFoundNotACrash) {
  Result<std::unique_ptr<GpuSampler>> sampler = GpuSampler::Open("libfanrun-no-such-nvml.so");
  ASSERT_FALSE(sampler.ok());
  EXPECT_EQ(sampler.status().code(), StatusCode::kNotFound);
  EXPECT_NE(sampler.status().message().find("libfanrun-no-such-nvml.so could not be loaded"), std::string::npos);
}

TEST(GpuSamplerTest, ALibraryThatIsNotNvmlIsAnInternalError) {
  // libc loads, but has none of NVML's functions.
  Result<std::unique_ptr<GpuSampler>> sampler = GpuSampler::Open("libc.so.6");
  ASSERT_FALSE(sampler.ok());
  EXPECT_EQ(sampler.status().code(), StatusCode::kInternal);
  EXPECT_NE(sampler.status().message().find("lacks an NVML function"), std::string::npos);
}

// Runs only where there is a driver (the GPU machines); elsewhere it says why it skipped.
TEST(GpuSamplerTest, SamplesEveryGpuOfTheMachine) {
  GpuInventory inventory = DetectGpus();
  if (inventory.gpus.empty()) GTEST_SKIP() << "no GPU: " << inventory.note;
  Result<std::unique_ptr<GpuSampler>> sampler = GpuSampler::Open();
  ASSERT_TRUE(sampler.ok()) << sampler.status().message();
  std::vector<int> indices;
  for (const auto& gpu : inventory.gpus) indices.push_back(gpu.nvml_index);
  for (int round = 0; round < 2; ++round) {  // NVML stays open between samples
    Result<std::vector<GpuSample>> samples = (*sampler)->Sample(indices);
    ASSERT_TRUE(samples.ok()) << samples.status().message();
    ASSERT_EQ(samples->size(), indices.size());
    for (size_t i = 0; i < indices.size(); ++i) {
      const GpuSample& sample = (*samples)[i];
      EXPECT_EQ(sample.nvml_index, indices[i]);
      EXPECT_TRUE(sample.has_utilization);
      EXPECT_LE(sample.utilization_percent, 100u);
      EXPECT_TRUE(sample.has_memory);
      EXPECT_EQ(sample.memory_total, inventory.gpus[i].memory_total);
      EXPECT_LE(sample.memory_used, sample.memory_total);
    }
  }
  Result<std::vector<GpuSample>> beyond = (*sampler)->Sample({static_cast<int>(indices.size())});
  ASSERT_FALSE(beyond.ok());
  EXPECT_EQ(beyond.status().code(), StatusCode::kInvalid);
}

TEST(VisibleDevicesTest, UnsetMeansAll) {
  EXPECT_EQ(Indices(ApplyVisibleDevices(FourGpus(), false, "")), (std::vector<int>{0, 1, 2, 3}));
}

TEST(VisibleDevicesTest, IndicesSelectAndReorder) {
  EXPECT_EQ(Indices(ApplyVisibleDevices(FourGpus(), true, "2,0")), (std::vector<int>{2, 0}));
  EXPECT_EQ(Indices(ApplyVisibleDevices(FourGpus(), true, " 3 , 1 ")), (std::vector<int>{3, 1}));
}

TEST(VisibleDevicesTest, EmptyOrInvalidHidesEverythingFromThere) {
  EXPECT_TRUE(ApplyVisibleDevices(FourGpus(), true, "").empty());
  EXPECT_TRUE(ApplyVisibleDevices(FourGpus(), true, "-1").empty());
  EXPECT_EQ(Indices(ApplyVisibleDevices(FourGpus(), true, "1,7,2")), (std::vector<int>{1}));
}

TEST(VisibleDevicesTest, UuidPrefixes) {
  EXPECT_EQ(Indices(ApplyVisibleDevices(FourGpus(), true, "GPU-2aaaa,GPU-0")), (std::vector<int>{2, 0}));
  // "GPU-" alone matches all four: ambiguous, so CUDA sees none from there.
  EXPECT_TRUE(ApplyVisibleDevices(FourGpus(), true, "GPU-").empty());
}

}  // namespace
}  // namespace fanrun
