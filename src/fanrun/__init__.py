"""fanrun: run one Python function on every accelerator of a machine and get back what every rank returned."""

from importlib import import_module as _import_module
from typing import TYPE_CHECKING

from ._accelerators import DEFAULT_CPU_RANKS as DEFAULT_CPU_RANKS
from ._accelerators import AcceleratorType as AcceleratorType
from ._accelerators import GPUType as GPUType
from ._errors import AcceleratorMismatchError as AcceleratorMismatchError
from ._errors import CallArgumentsError as CallArgumentsError
from ._errors import ClusterResourcesError as ClusterResourcesError
from ._errors import DescriptorLimitError as DescriptorLimitError
from ._errors import EngineError as EngineError
from ._errors import EngineInvalidArgument as EngineInvalidArgument
from ._errors import EngineOSError as EngineOSError
from ._errors import ExecutableNotFoundError as ExecutableNotFoundError
from ._errors import FanrunError as FanrunError
from ._errors import GpuHealthError as GpuHealthError
from ._errors import NodeEnvironmentError as NodeEnvironmentError
from ._errors import NodeLostError as NodeLostError
from ._errors import PayloadSerializationError as PayloadSerializationError
from ._errors import PayloadSizeWarning as PayloadSizeWarning
from ._errors import RankFailedError as RankFailedError
from ._errors import RankStalledError as RankStalledError
from ._errors import RemoteTraceback as RemoteTraceback
from ._errors import ResultSerializationError as ResultSerializationError
from ._errors import RunCancelledError as RunCancelledError
from ._errors import RunNotFoundError as RunNotFoundError
from ._errors import RunTimeoutError as RunTimeoutError
from ._errors import StacksError as StacksError
from ._errors import TrackingWarning as TrackingWarning
from ._errors import UnknownRunError as UnknownRunError
from ._errors import UnsafePathError as UnsafePathError
from ._errors import WorkingDirectoryError as WorkingDirectoryError

from ._version import __version__ as __version__

# The call machinery (the decorator, the launcher, tracking) is loaded when first named, so that
# what runs inside a rank (`import fanrun.data`) loads none of it.
_CALL_MACHINERY = {
    "distributed": "_decorator",
    "DistributedFunction": "_decorator",
    "TorchDistributor": "_torch_distributor",
    "flush_tracking": "_tracking.caller",
    "warmup": "_warmup",
    "cooldown": "_warmup",
    "Run": "_detached.run",
    "attach": "_detached.run",
    "runs": "_detached.run",
    "stacks": "_launch.stacks",
    # Ray is imported by these alone, when they are called.
    "ray_init": "backends.ray.connect",
    "ray_shutdown": "backends.ray.connect",
}

if TYPE_CHECKING:
    from ._decorator import DistributedFunction as DistributedFunction
    from ._decorator import distributed as distributed
    from ._torch_distributor import TorchDistributor as TorchDistributor
    from ._tracking.caller import flush_tracking as flush_tracking
    from ._detached.run import Run as Run
    from ._detached.run import attach as attach
    from ._detached.run import runs as runs
    from ._launch.stacks import stacks as stacks
    from ._warmup import cooldown as cooldown
    from ._warmup import warmup as warmup
    from .backends.ray.connect import ray_init as ray_init
    from .backends.ray.connect import ray_shutdown as ray_shutdown


def __getattr__(name: str):
    module = _CALL_MACHINERY.get(name)
    if module is None:
        raise AttributeError(f"module 'fanrun' has no attribute {name!r}")
    value = getattr(_import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


# The public names, loaded or not; subpackages (fanrun.data) are imported by name.
__all__ = [
    "AcceleratorMismatchError",
    "AcceleratorType",
    "CallArgumentsError",
    "ClusterResourcesError",
    "DEFAULT_CPU_RANKS",
    "DescriptorLimitError",
    "DistributedFunction",
    "EngineError",
    "EngineInvalidArgument",
    "EngineOSError",
    "ExecutableNotFoundError",
    "FanrunError",
    "GPUType",
    "GpuHealthError",
    "NodeEnvironmentError",
    "NodeLostError",
    "PayloadSerializationError",
    "PayloadSizeWarning",
    "RankFailedError",
    "RankStalledError",
    "RemoteTraceback",
    "ResultSerializationError",
    "Run",
    "RunCancelledError",
    "RunNotFoundError",
    "RunTimeoutError",
    "StacksError",
    "TorchDistributor",
    "TrackingWarning",
    "UnknownRunError",
    "UnsafePathError",
    "WorkingDirectoryError",
    "attach",
    "cooldown",
    "distributed",
    "flush_tracking",
    "ray_init",
    "ray_shutdown",
    "runs",
    "stacks",
    "warmup",
]
del TYPE_CHECKING  # a name for type checkers, not part of the package


def __dir__() -> list[str]:
    # Subpackages become attributes once imported (fanrun.backends, by the launcher); dir() shows
    # what the package offers, the same before and after.
    return sorted({*__all__, *(name for name in globals() if name.startswith("_"))})
