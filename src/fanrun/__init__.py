"""fanrun: run one Python function on every accelerator of a machine and get back what every rank returned."""

from ._accelerators import DEFAULT_CPU_RANKS as DEFAULT_CPU_RANKS
from ._accelerators import AcceleratorType as AcceleratorType
from ._accelerators import GPUType as GPUType
from ._decorator import DistributedFunction as DistributedFunction
from ._decorator import distributed as distributed
from ._errors import AcceleratorMismatchError as AcceleratorMismatchError
from ._errors import DescriptorLimitError as DescriptorLimitError
from ._errors import FanrunError as FanrunError
from ._errors import PayloadSerializationError as PayloadSerializationError
from ._errors import RankFailedError as RankFailedError
from ._errors import ResultSerializationError as ResultSerializationError
from ._errors import RunTimeoutError as RunTimeoutError
from ._errors import UnsafePathError as UnsafePathError
from ._errors import WorkingDirectoryError as WorkingDirectoryError
from ._torch_distributor import TorchDistributor as TorchDistributor
from ._tracking import flush_tracking as flush_tracking

__version__ = "0.1.0"
