// What the engine's two NVML readers (accelerators.cc, gpu_health.cc) share: the C types of the
// nvml.h entry points they take, and their lookup in the library loaded with dlopen.
#pragma once

#include <dlfcn.h>

namespace fanrun::nvml {

using nvmlReturn_t = int;
using nvmlDevice_t = void*;
constexpr nvmlReturn_t kSuccess = 0;
struct NvmlMemory {
  unsigned long long total, free, used;
};
struct NvmlUtilization {
  unsigned int gpu, memory;  // percent of the last sample period
};

// Looks `name` up in the opened library; false where this driver lacks it.
template <typename F>
bool Bind(void* handle, const char* name, F& out) {
  out = reinterpret_cast<F>(::dlsym(handle, name));
  return out != nullptr;
}

}  // namespace fanrun::nvml
