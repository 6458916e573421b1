"""Accelerator types, their legacy names, and the choice of what a run uses on this machine."""

from __future__ import annotations

import dataclasses
import enum
import functools
import os
import re
import warnings

from ._errors import AcceleratorMismatchError, GpuHealthError

# CPU processes a run starts where there is no GPU and num_accelerators is not given:
# enough to exercise real distributed code, few enough for a laptop.
DEFAULT_CPU_RANKS = 2
# At most this many CPU ranks per core this process may run on, unless MAX_CPU_RANKS_VAR says
# otherwise: a mistyped count (10**6) would otherwise fork the machine to its knees.
CPU_RANKS_PER_CORE = 4
MAX_CPU_RANKS_VAR = "FANRUN_MAX_CPU_RANKS"


class AcceleratorType(str, enum.Enum):
    """Machine types as `GPU_<count>x<model>`; any string of that form is accepted too."""

    GPU_1xA10 = "GPU_1xA10"
    GPU_1xH100 = "GPU_1xH100"
    GPU_8xH100 = "GPU_8xH100"
    GPU_8xB300 = "GPU_8xB300"
    GPU_1xH200 = "GPU_1xH200"
    GPU_2xH200 = "GPU_2xH200"
    GPU_8xH200 = "GPU_8xH200"
    GPU_1xA100 = "GPU_1xA100"
    GPU_8xA100 = "GPU_8xA100"
    GPU_1xL4 = "GPU_1xL4"
    CPU = "CPU"

    def __str__(self) -> str:
        return self.value


class GPUType(str, enum.Enum):
    """Legacy GPU models of the `serverless_gpu` package; use AcceleratorType instead."""

    A10 = "A10"
    H100 = "H100"
    B300 = "B300"

    def __str__(self) -> str:
        return self.value


_TYPE_PATTERN = re.compile(r"^GPU_(\d+)x([A-Za-z0-9]+)$")
_LEGACY_MODELS = {m.value for m in GPUType}


@dataclasses.dataclass(frozen=True)
class AcceleratorRequest:
    """What accelerator_type asks for: CPU processes, or GPUs of a model (and a count)."""

    cpu: bool = False
    model: str | None = None
    count: int | None = None
    text: str = ""


def parse_accelerator_type(value: object) -> AcceleratorRequest | None:
    """Validates accelerator_type; warns for legacy names. None means: detect."""
    if value is None:
        return None
    if isinstance(value, GPUType):
        _warn_legacy(f"GPUType.{value.name}", f"an AcceleratorType such as 'GPU_1x{value.value}'")
        return AcceleratorRequest(model=value.value, text=value.value)
    if not isinstance(value, str):
        raise TypeError(
            f"accelerator_type must be a string or an AcceleratorType, not {type(value).__name__}"
        )
    text = str(value).strip()
    if text.upper() == "CPU":
        return AcceleratorRequest(cpu=True, text="CPU")
    match = _TYPE_PATTERN.match(text)
    if match:
        count = int(match.group(1))
        if count < 1:
            raise ValueError(f"accelerator_type {text!r} names {count} GPUs; it must be at least 1")
        return AcceleratorRequest(model=match.group(2).upper(), count=count, text=text)
    if text.upper() in _LEGACY_MODELS:
        _warn_legacy(repr(text), f"an AcceleratorType such as 'GPU_1x{text.upper()}'")
        return AcceleratorRequest(model=text.upper(), text=text.upper())
    raise ValueError(
        f"accelerator_type {text!r} is not understood: use 'GPU_<count>x<model>' "
        f"(for example 'GPU_8xH100' or AcceleratorType.GPU_8xH100), or 'CPU'"
    )


def _warn_legacy(old: str, new: str) -> None:
    warnings.warn(f"{old} is a legacy name from serverless_gpu; use {new}", FutureWarning, stacklevel=4)


@dataclasses.dataclass(frozen=True)
class Gpu:
    nvml_index: int
    name: str
    uuid: str
    memory_total: int

    @property
    def model(self) -> str:
        """'NVIDIA A100-SXM4-80GB' -> 'A100', 'NVIDIA H200' -> 'H200'."""
        words = self.name.replace("NVIDIA", "").replace("-", " ").split()
        return words[0].upper() if words else self.name


@dataclasses.dataclass(frozen=True)
class Inventory:
    visible: tuple[Gpu, ...]  # what CUDA_VISIBLE_DEVICES lets this process use
    machine: tuple[Gpu, ...]  # every GPU of the machine
    note: str

    def describe(self, gpus: tuple[Gpu, ...] | None = None) -> str:
        gpus = self.visible if gpus is None else gpus
        if not gpus:
            return f"no GPU ({self.note})" if self.note else "no GPU"
        names: dict[str, int] = {}
        for gpu in gpus:
            names[gpu.name] = names.get(gpu.name, 0) + 1
        return ", ".join(f"{count} x {name}" for name, count in names.items())


@functools.cache
def _machine_gpus() -> tuple[tuple[dict, ...], str]:
    from . import _core

    found = _core.detect_gpus(os.environ.get("FANRUN_NVML_LIBRARY", "libnvidia-ml.so.1"))
    return tuple(found["gpus"]), found["note"]


def detect() -> Inventory:
    """The machine's GPUs (read once per process) and those CUDA_VISIBLE_DEVICES leaves visible."""
    from . import _core

    all_gpus, note = _machine_gpus()
    machine = tuple(Gpu(**g) for g in all_gpus)
    visible_var = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible_var is None:
        return Inventory(machine, machine, note)
    # The engine applies CUDA's own rules for indices and UUID prefixes.
    visible = _core.apply_visible_devices([dataclasses.asdict(g) for g in machine], visible_var)
    chosen = tuple(Gpu(**g) for g in visible)
    if not chosen and machine:
        note = f"CUDA_VISIBLE_DEVICES={visible_var!r} hides all {len(machine)} GPUs"
    return Inventory(chosen, machine, note)


@dataclasses.dataclass(frozen=True)
class Plan:
    """What a run uses: `world_size` ranks, each with a GPU or as a CPU process."""

    world_size: int
    use_gpus: bool
    description: str  # "2 x NVIDIA H200", "2 CPU processes"
    accelerator_type: str  # "GPU_2xH200" or "CPU"
    # Where GPUs were looked for and none was found, and the count was fanrun's default: what was
    # started instead, for the caller to show once.
    notice: str = ""
    # More CPU ranks than this process has cores: what that costs, for the caller to show once.
    warning: str = ""
    # Machines the ranks are spread over, world_size / nodes on each: one, this machine, unless a
    # cluster backend places them.
    nodes: int = 1
    # Where the ranks run: "local" (this machine) or "ray"; and for a cluster, how long the caller
    # waits for the cluster to fit the run before it says what is missing.
    backend: str = "local"
    placement_timeout_s: float = 60.0
    # A Slurm call's srun options (slurm=), as (name, value) pairs.
    slurm: tuple[tuple[str, str], ...] = ()


def plan_run(num_accelerators: int | None, request: AcceleratorRequest | None, inventory: Inventory, *,
             gpus_required: tuple[str, str] | None = None) -> Plan:
    """Checks the request against the hardware; every mismatch is an error here, before any process starts.
    `gpus_required`: the caller asked for GPUs, not CPU processes: how it asked (serverless_gpu's
    "gpus=2", TorchDistributor's "use_gpu=True") and how to ask for CPU processes instead."""
    use_gpus = bool(inventory.visible) and not (request and request.cpu)
    if request and not request.cpu:
        _check_type_matches(request, inventory)
    if gpus_required is not None and not inventory.visible and not (request and request.cpu):
        asked, instead = gpus_required
        raise AcceleratorMismatchError(
            f"{asked} asks for GPUs, but this machine has {inventory.describe()}; to run CPU processes here, {instead}"
        )
    if use_gpus:
        available = len(inventory.visible)
        if num_accelerators is None:
            num_accelerators = available
        elif num_accelerators > available:
            raise AcceleratorMismatchError(
                f"num_accelerators={num_accelerators}, but this machine has {available} GPU"
                f"{'s' if available != 1 else ''} visible ({inventory.describe()}); "
                f"ask for at most {available}"
            )
        gpus = inventory.visible[:num_accelerators]
        model = gpus[0].model
        return Plan(num_accelerators, True, inventory.describe(gpus), f"GPU_{num_accelerators}x{model}")
    defaulted = num_accelerators is None
    if num_accelerators is None:
        num_accelerators = DEFAULT_CPU_RANKS
    limit, why = max_cpu_ranks()
    if num_accelerators > limit:
        raise AcceleratorMismatchError(
            f"num_accelerators={num_accelerators} CPU processes is more than this machine allows: {limit} ({why}). "
            f"Ask for fewer, or set {MAX_CPU_RANKS_VAR} to the most CPU ranks a run may start"
        )
    noun = "process" if num_accelerators == 1 else "processes"
    description = f"{num_accelerators} CPU {noun}"
    notice = ""
    if defaulted and not inventory.visible and not (request and request.cpu):
        # Told only where fanrun chose: a count or a type given says the caller knows already.
        notice = f'no GPU found: {description}; use the gloo backend (init_process_group("gloo"))'
    cores = usable_cores()
    warning = ""
    if num_accelerators > cores:
        warning = (f"{description} share the {cores} core{'s' if cores != 1 else ''} this process may use, so each "
                   f"runs slower than one alone and a collective waits for the slowest; ask for at most {cores}")
    return Plan(num_accelerators, False, description, "CPU", notice, warning)


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity, which a container or taskset narrows)."""
    return len(os.sched_getaffinity(0))


def max_cpu_ranks() -> tuple[int, str]:
    """The most CPU ranks one run may start here, and where that number comes from."""
    configured = os.environ.get(MAX_CPU_RANKS_VAR)
    if configured is not None:
        try:
            limit = int(configured)
        except ValueError:
            limit = 0
        if limit < 1:
            raise ValueError(f"{MAX_CPU_RANKS_VAR} must be a positive whole number, not {configured!r}")
        return limit, f"{MAX_CPU_RANKS_VAR}={limit}"
    cores = usable_cores()
    return CPU_RANKS_PER_CORE * cores, f"{CPU_RANKS_PER_CORE} per core, and this process may use {cores}"


def _check_type_matches(request: AcceleratorRequest, inventory: Inventory) -> None:
    machine = inventory.machine
    if not machine:
        raise AcceleratorMismatchError(
            f"accelerator_type {request.text!r} asks for GPUs, but this machine has {inventory.describe(machine)}; "
            f"leave accelerator_type unset (or 'CPU') to run CPU processes here"
        )
    if not inventory.visible:
        raise AcceleratorMismatchError(
            f"accelerator_type {request.text!r} asks for GPUs, but this process sees {inventory.describe()}; "
            f"make them visible, or leave accelerator_type unset (or 'CPU') to run CPU processes here"
        )
    models = {gpu.model for gpu in machine}
    # 'A10' matches an A10G, not an A100: the model may only grow by letters.
    fits = all(re.fullmatch(re.escape(request.model or "") + r"[A-Z]*", model) for model in models)
    if fits and request.count is not None and len(machine) < request.count:
        # The model is right and a GPU is missing: one fallen off the bus, or failed at boot.
        raise GpuHealthError(
            f"accelerator_type {request.text!r} asks for {request.count} GPUs, and the driver shows "
            f"{len(machine)} ({inventory.describe(machine)}, NVML indices "
            f"{', '.join(str(gpu.nvml_index) for gpu in machine)}): a GPU is missing, fallen off the bus or failed "
            f"at boot. Check `nvidia-smi` and the kernel log for Xid errors (Xid 79: fallen off the bus), reset or "
            f"reboot the node; or ask for 'GPU_{len(machine)}x{sorted(models)[0]}' to run on the GPUs it has")
    if not fits or (request.count is not None and request.count != len(machine)):
        raise AcceleratorMismatchError(
            f"accelerator_type {request.text!r} does not match this machine, which has "
            f"{inventory.describe(machine)}; use 'GPU_{len(machine)}x{sorted(models)[0]}' or leave it unset"
        )
