"""How many updates the worker process has run: a counter in shared memory, written there and read here."""

import struct
from multiprocessing import shared_memory
from typing import cast

from lightning_store.metrics._offload.process.arena import _Segment

_COUNT = struct.Struct("q")  # an aligned 8-byte write, which the other process reads whole


class _Progress(_Segment):
    """The number of updates the worker process has run (or passed over after a failed one), kept in shared memory.

    The parent tells from it whether the worker process has caught up, without a message: the worker process
    answers a run of updates at once (``messages._Ran``), and only some runs.

    Args:
        name: the segment the parent made, seen from the worker process; ``None`` makes a new one (the parent).
    """

    def __init__(self, name: str | None = None) -> None:
        self.shm = shared_memory.SharedMemory(create=name is None, size=_COUNT.size, name=name)
        self.buf = cast(memoryview, self.shm.buf)
        if name is None:
            _COUNT.pack_into(self.buf, 0, 0)

    @property
    def name(self) -> str:
        return self.shm.name

    def read(self) -> int:
        return int(_COUNT.unpack_from(self.buf, 0)[0])

    def write(self, count: int) -> None:
        _COUNT.pack_into(self.buf, 0, count)
