"""The cheap check: NVML's answers for one GPU judged into problems, one sentence each, that say
what is wrong and what to do. An answer NVML does not support on a GPU is not judged."""

from __future__ import annotations

from collections.abc import Collection

# nvmlClocksThrottleReasons bits that mean trouble with the hardware, not a GPU at rest or
# capped by an application clock: what each says, and where to look.
THROTTLE_TROUBLE = {
    0x8: "HW slowdown",
    0x20: "SW thermal slowdown",
    0x40: "HW thermal slowdown",
    0x80: "HW power brake",
}
# A GPU busier than this is at work: its PCIe link should run at its highest generation.
IDLE_BELOW_PERCENT = 10
# Memory in use that no process NVML lists accounts for, beyond this share of the GPU's and
# beyond what the driver keeps for itself, is held by someone this process cannot see.
FOREIGN_MEMORY_SHARE = 0.05
DRIVER_RESERVE_BYTES = 2 << 30
# NVML's "not available" (an unsigned -1) where the driver cannot tell a process's share.
_NOT_AVAILABLE = 1 << 63


def problems(reading: dict | None, uuid: str, own_pids: Collection[int]) -> list[str]:
    """What is wrong with one GPU; empty when nothing is. `reading`: the engine's (None where the
    driver no longer reports the GPU); `uuid`: the GPU's when the call was planned; `own_pids`:
    processes of this caller's (itself, its kept ranks) that may hold memory on it."""
    # No reading, or one without even a UUID: the driver lists the GPU but no longer answers for it.
    if reading is None or not reading["uuid"]:
        return ["the driver no longer reports it (fallen off the bus?): check `nvidia-smi` and the kernel log for "
                "Xid errors (Xid 79: GPU has fallen off the bus), then reset the GPU or reboot the node"]
    if reading["uuid"] and reading["uuid"] != uuid:
        return [f"the driver's GPU at this index is now {reading['uuid']}, another GPU: the GPUs changed since the "
                f"call was planned; call again"]
    found: list[str] = []
    ecc = reading["ecc_uncorrected_volatile"]
    if ecc:
        found.append(f"{ecc} uncorrectable ECC error{'s' if ecc != 1 else ''} since the driver loaded: its memory "
                     f"returned corrupt data; drain the GPU, reset it (nvidia-smi -r) and have it replaced if they "
                     f"come back")
    if reading["retired_pages_pending"]:
        found.append("memory pages wait to be retired: reset the GPU (nvidia-smi -r) or reboot the node to retire them")
    if reading["remapped_rows_failure"]:
        found.append("a memory row could not be remapped: its memory is failing beyond repair; have the GPU replaced")
    elif reading["remapped_rows_pending"]:
        found.append("memory rows wait to be remapped: reset the GPU (nvidia-smi -r) or reboot the node to remap them")
    reasons = reading["throttle_reasons"]
    if reasons:
        named = [name for bit, name in THROTTLE_TROUBLE.items() if reasons & bit]
        if named:
            found.append(f"its clocks are throttled ({', '.join(named)}; reasons 0x{reasons:x}): check its cooling and "
                         f"power (nvidia-smi -q -d PERFORMANCE,TEMPERATURE,POWER)")
    width, width_max = reading["pcie_width"], reading["pcie_width_max"]
    if width is not None and width_max is not None and width < width_max:
        found.append(f"its PCIe link runs at x{width} of x{width_max}: reseat the GPU or check its slot and riser")
    # A GPU at rest lowers its PCIe generation to save power (NVIDIA's GPUs do, by design): the
    # generation is judged only while the GPU is at work; the width, above, always.
    generation, generation_max = reading["pcie_generation"], reading["pcie_generation_max"]
    busy = (reading["utilization_percent"] or 0) >= IDLE_BELOW_PERCENT
    if busy and generation is not None and generation_max is not None and generation < generation_max:
        found.append(f"its PCIe link runs at generation {generation} of {generation_max} while the GPU is busy: "
                     f"check the slot's BIOS setting and the riser")
    found += _foreign_memory(reading, set(own_pids))
    return found


def _foreign_memory(reading: dict, own_pids: set[int]) -> list[str]:
    listed = reading["compute_processes"] or []
    found = []
    for process in listed:
        if process["pid"] in own_pids:
            continue
        found.append(f"process {process['pid']}{_command(process['pid'])} holds {_gib(process['used_memory'])} on it: "
                     f"another job is using this GPU; wait for it to end or stop it (nvidia-smi shows it)")
    # NVML lists only the processes of this PID namespace (another container's are not), and none
    # where it cannot: memory in use that no listed process accounts for is someone else's.
    accounted = sum(process["used_memory"] for process in listed if process["used_memory"] < _NOT_AVAILABLE)
    used, total = reading["memory_used"], reading["memory_total"]
    if used is not None and total and used - accounted > max(DRIVER_RESERVE_BYTES, FOREIGN_MEMORY_SHARE * total):
        found.append(f"{_gib(used - accounted)} of its memory is in use by no process this one can see (another "
                     f"container's, or one that ended without its memory freed): check `nvidia-smi` on the host")
    return found


def _gib(count: int) -> str:
    if count >= _NOT_AVAILABLE:
        return "memory"
    return f"{count / (1 << 30):.1f} GiB"


def _command(pid: int) -> str:
    """' (python)', where this process may read what the other one runs."""
    try:
        with open(f"/proc/{pid}/comm") as comm:
            return f" ({comm.read().strip()})"
    except OSError:
        return ""
