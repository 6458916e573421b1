"""fanrun.data: what a training function reads and writes inside @distributed: a streaming
file dataset with a node-wide cache, a dataset of a Delta or Parquet table's rows, and
checkpoint storage for torch.distributed.checkpoint."""

from .._errors import CacheLimitError as CacheLimitError
from .._errors import CheckpointCorruptError as CheckpointCorruptError
from .._errors import CheckpointExistsError as CheckpointExistsError
from .._errors import CheckpointNotSharedError as CheckpointNotSharedError
from .._errors import DataFileError as DataFileError
from .._errors import DataSourceError as DataSourceError
from .._errors import NotACheckpointError as NotACheckpointError
from .._errors import TableError as TableError
from .._errors import UnsafePathError as UnsafePathError
from .checkpoint import VolumeReader as VolumeReader
from .checkpoint import VolumeWriter as VolumeWriter
from .checkpoint import export_dcp as export_dcp
from .checkpoint import latest_checkpoint as latest_checkpoint
from ._dataset import UCVolumeDataset as UCVolumeDataset
from ._dataset import VolumeDataset as VolumeDataset
from ._loader import DataLoader as DataLoader
from ._table import TableDataset as TableDataset

# The names Databricks' UC Volumes plug-ins have, so that code written for them runs unchanged.
UCVolumeWriter = VolumeWriter
UCVolumeReader = VolumeReader
