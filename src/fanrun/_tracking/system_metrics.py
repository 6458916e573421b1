"""System metrics of a run, sampled in a thread of the tracking agent: per-GPU utilisation and
memory from NVML (through the engine), CPU and host memory from /proc; named as MLflow's own.
Each sample also holds the ranks' step times (rank_steps.py)."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Sequence

# MLflow's own default interval; MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL changes both.
DEFAULT_INTERVAL_S = 10.0
# A CPU reading over a shorter window than this says more about the scheduler than the load.
MIN_CPU_WINDOW_S = 0.05
PREFIX = "system/"

Log = Callable[[dict[str, float], int], None]


def sampling_interval() -> float:
    """MLflow's MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL when set to a positive number, else 10 s."""
    try:
        value = float(os.environ.get("MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL", ""))
    except ValueError:
        return DEFAULT_INTERVAL_S
    return value if value > 0 else DEFAULT_INTERVAL_S


class HostReader:
    """CPU utilisation between two readings of /proc/stat, and memory from /proc/meminfo."""

    def __init__(self) -> None:
        self._last = _cpu_times()
        self._last_at = time.monotonic()

    def read(self) -> dict[str, float]:
        metrics: dict[str, float] = {}
        now, times = time.monotonic(), _cpu_times()
        if times is not None and self._last is not None and now - self._last_at >= MIN_CPU_WINDOW_S:
            busy = times[0] - self._last[0]
            total = times[1] - self._last[1]
            if total > 0:
                metrics["cpu_utilization_percentage"] = round(100.0 * busy / total, 1)
            self._last, self._last_at = times, now
        memory = _memory()
        if memory is not None:
            used, total_memory = memory
            # Megabytes of 10**6 bytes, as MLflow's own monitor writes them.
            metrics["system_memory_usage_megabytes"] = round(used / 1e6, 1)
            metrics["system_memory_usage_percentage"] = round(100.0 * used / total_memory, 1)
        return metrics


class GpuReader:
    """Utilisation and memory of the run's GPUs; `gpu_<i>` is the GPU rank i uses (cuda:i there)."""

    def __init__(self, sampler, nvml_indices: Sequence[int]) -> None:
        self._sampler = sampler
        self._indices = list(nvml_indices)

    @classmethod
    def open(cls, nvml_indices: Sequence[int]) -> GpuReader | None:
        if not nvml_indices:
            return None
        sampler = _nvml_sampler(os.environ.get("FANRUN_NVML_LIBRARY", "libnvidia-ml.so.1"))
        return cls(sampler, nvml_indices) if sampler is not None else None

    def per_gpu(self) -> list[tuple[float | None, float | None]]:
        """(utilisation %, memory used in MB) of each GPU, in rank order: the live panel's."""
        return [(None if s["utilization_percent"] is None else float(s["utilization_percent"]),
                 None if s["memory_used"] is None else s["memory_used"] / 1e6) for s in self._sampler.sample(self._indices)]

    def read(self) -> dict[str, float]:
        metrics: dict[str, float] = {}
        for i, sample in enumerate(self._sampler.sample(self._indices)):
            if sample["utilization_percent"] is not None:
                metrics[f"gpu_{i}_utilization_percentage"] = float(sample["utilization_percent"])
            if sample["memory_used"] is not None:
                metrics[f"gpu_{i}_memory_usage_megabytes"] = round(sample["memory_used"] / 1e6, 1)
                if sample["memory_total"]:
                    metrics[f"gpu_{i}_memory_usage_percentage"] = round(
                        100.0 * sample["memory_used"] / sample["memory_total"], 1
                    )
        return metrics


_nvml_samplers: dict = {}
_nvml_lock = threading.Lock()


def _nvml_sampler(library: str):
    """NVML, initialised once per process and shared by every run's sampler: initialising it
    takes the driver's locks for a while, and a call's ranks are creating their CUDA contexts
    at that very moment."""
    with _nvml_lock:
        if library not in _nvml_samplers:
            from .. import _core

            _nvml_samplers[library] = _core.GpuSampler.open(library)[0]
        return _nvml_samplers[library]


class SystemMetricsSampler:
    """Logs a sample when started and every `interval` seconds until stopped; the owner logs the last.

    `log(metrics, step)` sends one sample; the first exception it raises ends the sampling
    (a tracking server that fails once is not asked again every interval) and is kept in `error`.
    `more()`, where given, adds its metrics to each sample under their own names (the ranks' step
    times, rank_steps.py): one interval, one step and one batch for every figure of the run.
    """

    def __init__(self, log: Log, gpu_indices: Sequence[int], interval: float, first_step: int = 0,
                 more: Callable[[], dict[str, float]] | None = None) -> None:
        self._log = log
        self._host = HostReader()
        self._gpus = GpuReader.open(gpu_indices)
        self._more = more
        self._interval = interval
        self._step = first_step
        self._stop = threading.Event()
        self._lock = threading.Lock()  # the thread's last sample and stop()'s final one never interleave
        self._thread = threading.Thread(target=self._loop, name="fanrun-system-metrics", daemon=True)
        self.error: BaseException | None = None

    def start(self) -> None:
        self._thread.start()

    def stop(self, join_timeout: float) -> bool:
        """Ends the thread at once (it waits on an Event, not in a sleep); False if a sample it
        is sending has not returned within `join_timeout`."""
        self._stop.set()
        self._thread.join(join_timeout)
        return not self._thread.is_alive()

    def _loop(self) -> None:
        self.sample()
        while not self._stop.wait(self._interval):
            self.sample()

    def sample(self) -> None:
        """Logs one sample now (the final one, after stop())."""
        with self._lock:
            if self.error is not None:
                return
            try:
                metrics = self._host.read()
                if self._gpus is not None:
                    metrics.update(self._gpus.read())
                named = {PREFIX + key: value for key, value in metrics.items()}
                if self._more is not None:
                    named.update(self._more())
                self._log(named, self._step)
                self._step += 1
            except Exception as error:
                self.error = error


def _cpu_times() -> tuple[int, int] | None:
    """(busy, total) jiffies of all CPUs since boot; iowait counts as idle, as in top."""
    try:
        with open("/proc/stat") as stat:
            fields = [int(v) for v in stat.readline().split()[1:9]]
    except (OSError, ValueError):
        return None
    user, nice, system, idle, iowait, irq, softirq, steal = (fields + [0] * 8)[:8]
    total = user + nice + system + idle + iowait + irq + softirq + steal
    return total - idle - iowait, total


def _memory() -> tuple[int, int] | None:
    """(used, total) bytes, where used is what the kernel cannot hand out (MemTotal - MemAvailable)."""
    values: dict[str, int] = {}
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                key, _, rest = line.partition(":")
                if key in ("MemTotal", "MemAvailable"):
                    values[key] = int(rest.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    if "MemTotal" not in values or "MemAvailable" not in values or values["MemTotal"] <= 0:
        return None
    return values["MemTotal"] - values["MemAvailable"], values["MemTotal"]
