"""fanrun.data: what a training function reads and writes inside @distributed."""

from ._dataset import UCVolumeDataset as UCVolumeDataset
from ._dataset import VolumeDataset as VolumeDataset
from ._loader import DataLoader as DataLoader
