"""Shared memory for the inputs sent to the worker process: one segment used as a ring, each update's at its head."""

import contextlib
from collections import deque
from multiprocessing import shared_memory

import torch
from torch import Tensor

from lightning_store.metrics._layout import ALIGNMENT

_INITIAL_BYTES = 16 * 2**20


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGNMENT) * ALIGNMENT  # each tensor starts as torch's CPU allocator aligns it


class _Arena:
    """A shared-memory segment the parent writes inputs into and the worker process reads them from.

    Space is taken at the head and given back at the tail, update by update, in the order the updates were sent,
    which is the order the worker runs them: a ring. An update whose inputs do not fit waits for the worker to give
    space back; one larger than the segment gets a larger segment, the old one freed once its updates have run.
    """

    def __init__(self, nbytes: int = _INITIAL_BYTES, name: str | None = None) -> None:
        """A new segment of ``nbytes``; or, with ``name``, the parent's segment seen from the worker process.

        A process spawned by the parent shares its resource tracker, where the segment is registered once: the
        parent unlinks it (or the tracker does, if the parent dies), never the worker.
        """
        if name is None:
            self.shm = shared_memory.SharedMemory(create=True, size=nbytes)
        else:
            self.shm = shared_memory.SharedMemory(name=name)
        self.size = self.shm.size
        self.head = 0
        self.spans: deque[tuple[int, int]] = deque()  # (start, end) of each update's inputs, oldest first
        self.retired = False  # a larger one took its place: freed once its updates have run

    @property
    def name(self) -> str:
        return self.shm.name

    def take(self, nbytes: int) -> int | None:
        """The offset of ``nbytes`` of free space (aligned), or ``None`` if they do not fit now."""
        nbytes = _aligned(max(nbytes, 1))
        if not self.spans:
            self.head = 0
        tail = self.spans[0][0] if self.spans else 0
        if not self.spans or self.head > tail:  # free: from the head to the end, then from the start to the tail
            if self.head + nbytes <= self.size:
                start = self.head
            elif nbytes <= tail:
                start = 0
            else:
                return None
        elif self.head + nbytes <= tail:  # wrapped: free from the head to the tail
            start = self.head
        else:
            return None
        self.spans.append((start, start + nbytes))
        self.head = start + nbytes
        return start

    def give_back(self) -> None:
        """Give back the oldest update's space (the worker has run it)."""
        self.spans.popleft()

    def tensor(self, offset: int, dtype: torch.dtype, count: int) -> Tensor:
        """``count`` elements of ``dtype`` at byte ``offset``, on the segment's memory."""
        if not count:
            return torch.empty(0, dtype=dtype)
        return torch.frombuffer(self.shm.buf, dtype=dtype, count=count, offset=offset)

    def close(self, unlink: bool) -> None:
        with contextlib.suppress(BufferError):  # a tensor still views it: the mapping goes with the process
            self.shm.close()
        if unlink:
            self.shm.unlink()
