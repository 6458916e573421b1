"""Distributed checkpoints: storage plug-ins for torch.distributed.checkpoint over the engine's I/O.

  writer.py      VolumeWriter: each rank's file written by the engine, the checkpoint published at once
  reader.py      VolumeReader: items read by the engine straight into their tensors, every CRC checked
  storage.py     where checkpoints live (a local directory, or an fsspec URL), and latest_checkpoint
  layout.py      the on-disk format: file names, the record, item locations
  engine_io.py   what the writer and the reader share: options, batches, the durable small write
  staging.py     dcp.async_save's copies to host memory
  dcp_format.py  reading checkpoints in DCP's own format; dcp_export.py writes one
"""

from .dcp_export import export_dcp as export_dcp
from .reader import VolumeReader as VolumeReader
from .storage import latest_checkpoint as latest_checkpoint
from .writer import VolumeWriter as VolumeWriter
