"""DataLoader workers make their first batches in turn: worker k starts reading once worker
k-1 has made its first batch.

The main process takes one batch from each worker in turn, worker 0's first. Started all at
once, the workers share the disk's or the server's bandwidth, and so worker 0's first batch
is ready only about when every worker's is: with 2 ranks x 4 workers reading 10 MB files
from a cold disk or from nginx, 0.9-1.7 s, against 0.35-0.6 s in turn (benchmarks/data.py).
In turn, the same bytes are read in the same time, in the order the main process wants them.

A worker whose first batch's files are all in the page cache shares no disk with the others:
it starts at once and passes the turn on as it reaches it (Turn.pass_on). Waiting there cost
the workers their parallelism: with 2 ranks x 4 workers over 200 warm 10 MB files on 16 cores,
each worker makes only two or three batches, and in turn the first four of each rank's seven
were made one after another (VolumeDataset at 0.62x a plain Dataset).

A chain of pipes, made by fanrun.data.DataLoader before it forks its workers: worker k
waits to read one byte from pipe k-1, which worker k-1 writes once its first batch is made,
or when it stops for any reason; if it dies, its end closes and the wait ends too.
"""

from __future__ import annotations

import os
import threading


class FirstBatchTurns:
    """Made in the main process before the workers are forked; closed there once they are."""

    def __init__(self, num_workers: int) -> None:
        self.owner = os.getpid()
        self._pipes = [os.pipe() for _ in range(num_workers - 1)]  # pipe k-1 lets worker k start

    def close(self) -> None:
        for read_end, write_end in self._pipes:
            os.close(read_end)
            os.close(write_end)
        self._pipes = []

    def turn(self, worker: int) -> Turn:
        """In worker `worker`: its own two ends; the others are closed, so that a worker that
        dies closes the last copy of its write end."""
        wait_fd = release_fd = None
        for k, (read_end, write_end) in enumerate(self._pipes):
            if k == worker - 1:
                wait_fd = read_end
            else:
                os.close(read_end)
            if k == worker:
                release_fd = write_end
            else:
                os.close(write_end)
        self._pipes = []
        return Turn(wait_fd, release_fd)


class Turn:
    def __init__(self, wait_fd: int | None, release_fd: int | None) -> None:
        self._wait_fd = wait_fd
        self._release_fd = release_fd

    def wait(self) -> None:
        """Until the worker before has made its first batch (a byte) or ended (end of file)."""
        if self._wait_fd is not None:
            os.read(self._wait_fd, 1)
            os.close(self._wait_fd)
            self._wait_fd = None

    def pass_on(self) -> None:
        """Without waiting here: the next worker starts when the one before this one has made
        its first batch, as if this one's had been made at once."""
        if self._wait_fd is None:
            self.release()
            return
        threading.Thread(target=self._relay, name="fanrun-first-batch-turn", daemon=True).start()

    def _relay(self) -> None:
        self.wait()
        self.release()

    def release(self) -> None:
        """Lets the next worker start; once."""
        if self._release_fd is not None:
            os.write(self._release_fd, b"\0")
            os.close(self._release_fd)
            self._release_fd = None
