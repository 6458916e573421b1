"""fanrun.data: what a training function reads and writes inside @distributed: a streaming
file dataset with a node-wide cache, and checkpoint storage for torch.distributed.checkpoint."""

from .._errors import CheckpointCorruptError as CheckpointCorruptError
from .._errors import CheckpointExistsError as CheckpointExistsError
from .._errors import NotACheckpointError as NotACheckpointError
from ._checkpoint_dcp_export import export_dcp as export_dcp
from ._checkpoint_reader import VolumeReader as VolumeReader
from ._checkpoint_storage import latest_checkpoint as latest_checkpoint
from ._checkpoint_writer import VolumeWriter as VolumeWriter
from ._dataset import UCVolumeDataset as UCVolumeDataset
from ._dataset import VolumeDataset as VolumeDataset
from ._loader import DataLoader as DataLoader

# The names Databricks' UC Volumes plug-ins have, so that code written for them runs unchanged.
UCVolumeWriter = VolumeWriter
UCVolumeReader = VolumeReader
