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
