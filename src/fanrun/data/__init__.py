"""fanrun.data: libraries for inside the distributed function: checkpoint storage for
torch.distributed.checkpoint."""

from .._errors import CheckpointCorruptError as CheckpointCorruptError
from .._errors import CheckpointExistsError as CheckpointExistsError
from .._errors import NotACheckpointError as NotACheckpointError
from ._checkpoint_reader import VolumeReader as VolumeReader
from ._checkpoint_storage import latest_checkpoint as latest_checkpoint
from ._checkpoint_writer import VolumeWriter as VolumeWriter

# The names Databricks' UC Volumes plug-ins have, so that code written for them runs unchanged.
UCVolumeWriter = VolumeWriter
UCVolumeReader = VolumeReader
