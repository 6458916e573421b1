/* A stand-in libnvidia-ml.so that answers from recorded answers: the fault-injection seam of the
 * GPU health gate. Loaded through FANRUN_NVML_LIBRARY, it lets the real reader (gpu_health.cc,
 * accelerators.cc) and the real call path meet an ECC error, a throttled clock or a missing GPU
 * on a machine without one. Built for the tests only; never shipped.
 *
 * FANRUN_RECORDED_NVML names the answers' file, read at every nvmlInit_v2 and read again when it changes
 * while NVML stays open, as a real GPU's answers change (a process starts holding memory). One answer a line:
 *
 *   driver 550.54.15
 *   gpu 0                          (starts a GPU's answers; the GPUs are counted in this order)
 *   name NVIDIA H200
 *   uuid GPU-...
 *   memory TOTAL USED              (bytes)
 *   ecc_uncorrected N
 *   retired_pages_pending 0|1
 *   remapped_rows CORRECTED UNCORRECTED PENDING FAILURE
 *   throttle_reasons 0x..
 *   pcie GEN MAX_GEN WIDTH MAX_WIDTH
 *   utilization PERCENT
 *   process PID USED_BYTES          (one line per process holding memory)
 *
 * An answer left out is NVML_ERROR_NOT_SUPPORTED, as an older GPU or driver gives. '#' starts a comment. */
#define _POSIX_C_SOURCE 200809L /* fileno, and stat's st_mtim */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

enum { kSuccess = 0, kUninitialized = 1, kInvalidArgument = 2, kNotSupported = 3, kInsufficientSize = 7,
       kNotFound = 6, kMaxGpus = 16, kMaxProcesses = 16, kText = 96 };

typedef struct {
  unsigned long long total, free, used;
} Memory;
typedef struct {
  unsigned int gpu, memory;
} Utilization;
typedef struct { /* nvmlProcessInfo_v2_t */
  unsigned int pid;
  unsigned long long used_gpu_memory;
  unsigned int gpu_instance_id, compute_instance_id;
} ProcessInfo;

typedef struct {
  char name[kText], uuid[kText];
  int has_memory, has_ecc, has_retired, has_remapped, has_throttle, has_pcie, has_utilization;
  unsigned long long memory_total, memory_used, ecc_uncorrected, throttle_reasons;
  unsigned int retired_pending, remapped[4], pcie[4], utilization;
  unsigned int process_count, process_pid[kMaxProcesses];
  unsigned long long process_used[kMaxProcesses];
} Gpu;

static Gpu gpus[kMaxGpus];
static unsigned int gpu_count = 0;
static char driver[kText] = "recorded";
static int initialised = 0;
static struct stat loaded; /* the answers' file as it was when last read */

static void CopyText(char* to, const char* from) {
  strncpy(to, from, kText - 1);
  to[kText - 1] = '\0';
  to[strcspn(to, "\r\n")] = '\0';
}

static int Load(void) {
  const char* path = getenv("FANRUN_RECORDED_NVML");
  FILE* file = path != NULL ? fopen(path, "r") : NULL;
  char line[512];
  Gpu* gpu = NULL;
  if (file == NULL) return kUninitialized; /* as NVML without a driver behind it */
  if (fstat(fileno(file), &loaded) != 0) memset(&loaded, 0, sizeof(loaded));
  memset(gpus, 0, sizeof(gpus));
  gpu_count = 0;
  while (fgets(line, sizeof(line), file) != NULL) {
    char key[64] = {0};
    int offset = 0;
    char* comment = strchr(line, '#');
    if (comment != NULL) *comment = '\0';
    if (sscanf(line, "%63s %n", key, &offset) < 1) continue;
    const char* rest = line + offset;
    if (strcmp(key, "driver") == 0) {
      CopyText(driver, rest);
    } else if (strcmp(key, "gpu") == 0) {
      if (gpu_count == kMaxGpus) break;
      gpu = &gpus[gpu_count++];
    } else if (gpu == NULL) {
      continue; /* an answer before any "gpu" line belongs to no GPU */
    } else if (strcmp(key, "name") == 0) {
      CopyText(gpu->name, rest);
    } else if (strcmp(key, "uuid") == 0) {
      CopyText(gpu->uuid, rest);
    } else if (strcmp(key, "memory") == 0) {
      gpu->has_memory = sscanf(rest, "%llu %llu", &gpu->memory_total, &gpu->memory_used) == 2;
    } else if (strcmp(key, "ecc_uncorrected") == 0) {
      gpu->has_ecc = sscanf(rest, "%llu", &gpu->ecc_uncorrected) == 1;
    } else if (strcmp(key, "retired_pages_pending") == 0) {
      gpu->has_retired = sscanf(rest, "%u", &gpu->retired_pending) == 1;
    } else if (strcmp(key, "remapped_rows") == 0) {
      gpu->has_remapped = sscanf(rest, "%u %u %u %u", &gpu->remapped[0], &gpu->remapped[1], &gpu->remapped[2],
                                 &gpu->remapped[3]) == 4;
    } else if (strcmp(key, "throttle_reasons") == 0) {
      gpu->has_throttle = sscanf(rest, "%llx", &gpu->throttle_reasons) == 1;
    } else if (strcmp(key, "pcie") == 0) {
      gpu->has_pcie = sscanf(rest, "%u %u %u %u", &gpu->pcie[0], &gpu->pcie[1], &gpu->pcie[2], &gpu->pcie[3]) == 4;
    } else if (strcmp(key, "utilization") == 0) {
      gpu->has_utilization = sscanf(rest, "%u", &gpu->utilization) == 1;
    } else if (strcmp(key, "process") == 0 && gpu->process_count < kMaxProcesses) {
      unsigned int n = gpu->process_count;
      if (sscanf(rest, "%u %llu", &gpu->process_pid[n], &gpu->process_used[n]) == 2) gpu->process_count = n + 1;
    }
  }
  fclose(file);
  return kSuccess;
}

static Gpu* Of(void* device) { return (Gpu*)device; }

int nvmlInit_v2(void) {
  int answer = Load();
  initialised = answer == kSuccess;
  return answer;
}
int nvmlShutdown(void) {
  initialised = 0;
  return kSuccess;
}
int nvmlSystemGetDriverVersion(char* text, unsigned int length) {
  if (length == 0) return kInvalidArgument;
  snprintf(text, length, "%s", driver);
  return kSuccess;
}
int nvmlDeviceGetCount_v2(unsigned int* count) {
  if (!initialised) return kUninitialized;
  *count = gpu_count;
  return kSuccess;
}
/* Reads the answers again where their file was written since (a rank that starts holding memory),
 * keeping the GPUs' count, which NVML fixes at its start. */
static void Refresh(void) {
  struct stat now;
  const char* path = getenv("FANRUN_RECORDED_NVML");
  unsigned int count = gpu_count;
  if (path == NULL || stat(path, &now) != 0) return;
  if (now.st_mtim.tv_sec == loaded.st_mtim.tv_sec && now.st_mtim.tv_nsec == loaded.st_mtim.tv_nsec &&
      now.st_size == loaded.st_size && now.st_ino == loaded.st_ino)
    return;
  if (Load() == kSuccess && gpu_count > count) gpu_count = count;
}

int nvmlDeviceGetHandleByIndex_v2(unsigned int index, void** device) {
  if (!initialised) return kUninitialized;
  Refresh();
  if (index >= gpu_count) return kInvalidArgument;
  *device = &gpus[index];
  return kSuccess;
}
int nvmlDeviceGetName(void* device, char* text, unsigned int length) {
  if (length == 0) return kInvalidArgument;
  snprintf(text, length, "%s", Of(device)->name);
  return kSuccess;
}
int nvmlDeviceGetUUID(void* device, char* text, unsigned int length) {
  if (length == 0) return kInvalidArgument;
  snprintf(text, length, "%s", Of(device)->uuid);
  return kSuccess;
}
int nvmlDeviceGetMemoryInfo(void* device, Memory* memory) {
  Gpu* gpu = Of(device);
  if (!gpu->has_memory) return kNotSupported;
  memory->total = gpu->memory_total;
  memory->used = gpu->memory_used;
  memory->free = gpu->memory_total - gpu->memory_used;
  return kSuccess;
}
int nvmlDeviceGetUtilizationRates(void* device, Utilization* utilization) {
  Gpu* gpu = Of(device);
  if (!gpu->has_utilization) return kNotSupported;
  utilization->gpu = gpu->utilization;
  utilization->memory = 0;
  return kSuccess;
}
int nvmlDeviceGetTotalEccErrors(void* device, int error_type, int counter_type, unsigned long long* count) {
  Gpu* gpu = Of(device);
  if (!gpu->has_ecc) return kNotSupported;
  if (error_type != 1 || counter_type != 0) return kNotFound; /* only uncorrected, volatile is recorded */
  *count = gpu->ecc_uncorrected;
  return kSuccess;
}
int nvmlDeviceGetRetiredPagesPendingStatus(void* device, int* pending) {
  Gpu* gpu = Of(device);
  if (!gpu->has_retired) return kNotSupported;
  *pending = gpu->retired_pending != 0;
  return kSuccess;
}
int nvmlDeviceGetRemappedRows(void* device, unsigned int* corrected, unsigned int* uncorrected,
                              unsigned int* pending, unsigned int* failure) {
  Gpu* gpu = Of(device);
  if (!gpu->has_remapped) return kNotSupported;
  *corrected = gpu->remapped[0];
  *uncorrected = gpu->remapped[1];
  *pending = gpu->remapped[2];
  *failure = gpu->remapped[3];
  return kSuccess;
}
int nvmlDeviceGetCurrentClocksThrottleReasons(void* device, unsigned long long* reasons) {
  Gpu* gpu = Of(device);
  if (!gpu->has_throttle) return kNotSupported;
  *reasons = gpu->throttle_reasons;
  return kSuccess;
}
static int Pcie(void* device, int which, unsigned int* value) {
  Gpu* gpu = Of(device);
  if (!gpu->has_pcie) return kNotSupported;
  *value = gpu->pcie[which];
  return kSuccess;
}
int nvmlDeviceGetCurrPcieLinkGeneration(void* device, unsigned int* value) { return Pcie(device, 0, value); }
int nvmlDeviceGetMaxPcieLinkGeneration(void* device, unsigned int* value) { return Pcie(device, 1, value); }
int nvmlDeviceGetCurrPcieLinkWidth(void* device, unsigned int* value) { return Pcie(device, 2, value); }
int nvmlDeviceGetMaxPcieLinkWidth(void* device, unsigned int* value) { return Pcie(device, 3, value); }
int nvmlDeviceGetComputeRunningProcesses_v3(void* device, unsigned int* count, ProcessInfo* infos) {
  Gpu* gpu = Of(device);
  unsigned int i;
  if (*count < gpu->process_count) {
    *count = gpu->process_count;
    return kInsufficientSize;
  }
  for (i = 0; i < gpu->process_count; ++i) {
    infos[i].pid = gpu->process_pid[i];
    infos[i].used_gpu_memory = gpu->process_used[i];
    infos[i].gpu_instance_id = 0xFFFFFFFFu;
    infos[i].compute_instance_id = 0xFFFFFFFFu;
  }
  *count = gpu->process_count;
  return kSuccess;
}
