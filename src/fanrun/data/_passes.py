"""What VolumeDataset and TableDataset share: a pass over the epoch, begun by fanrun.data.DataLoader
(which then counts the items its main process received) or by the dataset's own iteration in the
main process (which counts them itself), so that state_dict() knows what was consumed."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch.utils.data


class CountedPasses:
    _loader_counts = False  # a fanrun.data.DataLoader pass counts consumption in the main process
    _consumed = 0  # items the main process received in this pass

    def _begin_pass(self, by_loader: bool = False, num_workers: int = 0) -> None:
        raise NotImplementedError

    def _pass_started(self) -> None:
        raise NotImplementedError

    def _counted(self, items: Iterator[Any]) -> Iterator[Any]:
        """`items`, counted where the main process iterates the dataset itself."""
        if torch.utils.data.get_worker_info() is not None or self._loader_counts:
            yield from items
            return
        for item in items:
            self._consumed += 1
            yield item

    def _own_pass(self) -> bool:
        """Begins a pass where no loader did (the main process iterating the dataset itself);
        whether it is in a DataLoader worker."""
        in_worker = torch.utils.data.get_worker_info() is not None
        if not in_worker and not self._loader_counts:
            self._begin_pass()
            self._pass_started()
        return in_worker

    # ------------------------------------------------------------ fanrun.data.DataLoader's hooks

    def _count_consumed(self, items: int) -> None:
        self._consumed += items

    def _end_pass(self) -> None:
        self._loader_counts = False
