"""Shared memory for the inputs sent to the worker process: rings, the one in use and those still read."""

import contextlib
import ctypes
import errno
import os
from collections import deque
from collections.abc import Callable
from multiprocessing import shared_memory
from typing import cast

import torch
from torch import Tensor

from lightning_store.metrics._offload.layout import ALIGNMENT
from lightning_store.metrics._offload.workers import _short_of

_INITIAL_BYTES = 16 * 2**20
_SHM = "/dev/shm"  # where POSIX shared memory lies on Linux: a tmpfs, 64 MB in a Docker container by default


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGNMENT) * ALIGNMENT  # each tensor starts as torch's CPU allocator aligns it


class _Segment:
    """A shared-memory segment of the parent's, whose name it removes once the worker process has it open.

    A segment lives until its name is removed and no process maps it. Once both processes have it open, its name is
    of no more use: removed then, the memory goes with the processes, however they end. A process group killed
    together (its terminal closed, ``kill -9`` to the group) takes down the resource tracker too, which would have
    removed the names of a parent that did not: they would hold ``/dev/shm``'s memory until the machine restarts.
    """

    shm: shared_memory.SharedMemory
    unlinked = False

    def unlink(self) -> None:
        """Remove the segment's name, once (the name may be another segment's since)."""
        if not self.unlinked:
            self.unlinked = True
            with contextlib.suppress(FileNotFoundError):
                self.shm.unlink()

    def close(self, unlink: bool) -> None:
        with contextlib.suppress(BufferError):  # a tensor still views it: the mapping goes with the process
            self.shm.close()
        if unlink:
            self.unlink()


class _Arena(_Segment):
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
            room = _room()
            if room is not None and room[0] < nbytes:
                raise _NoRoom(nbytes, room)
            try:
                self.shm = shared_memory.SharedMemory(create=True, size=nbytes)
                _reserve(self.shm, room)
            except OSError as error:  # no file descriptor or memory left, say
                raise _NoSegment(nbytes, error) from error
        else:
            self.shm = shared_memory.SharedMemory(name=name)
        self.size = self.shm.size
        # where its memory starts, in this process: read while the segment is open
        self.address = ctypes.addressof(ctypes.c_char.from_buffer(cast(memoryview, self.shm.buf)))
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

    def untake(self) -> None:
        """Give back the space last taken (its update was not sent)."""
        self.head = self.spans.pop()[0]

    def give_back(self) -> None:
        """Give back the oldest update's space (the worker has run it)."""
        self.spans.popleft()

    def tensor(self, offset: int, dtype: torch.dtype, count: int) -> Tensor:
        """``count`` elements of ``dtype`` at byte ``offset``, on the segment's memory."""
        if not count:
            return torch.empty(0, dtype=dtype)
        return torch.frombuffer(self.shm.buf, dtype=dtype, count=count, offset=offset)


_THROUGH_SHM = "lightning-store's offload worker process takes an update's inputs through shared memory"
_NO_SHM = "pass worker='thread' to offload_to_cpu, which needs no shared memory"


class _NoRoom(RuntimeError):
    """Too little room in ``/dev/shm`` for an arena: said before a write there would end the process (a Bus error)."""

    def __init__(self, nbytes: int, room: tuple[int, int] | None) -> None:
        free, total = room if room is not None else (0, 0)
        super().__init__(
            f"{_THROUGH_SHM}, in {_SHM}, which has {_size(free)} free of {_size(total)}: too little for the"
            f" {_size(nbytes)} these inputs need (written there, they would end this process with a Bus error). HINT:"
            " give the container more shared memory (`docker run --shm-size=8g`, or a memory-backed volume on"
            f" /dev/shm), pass smaller batches, or {_NO_SHM}."
        )


class _NoSegment(RuntimeError):
    """A segment for an update's inputs that could not be made (no file descriptor or memory left): said, with the fix.

    Raised at the call before its update is queued: nothing of it is done, and the next call tries again.
    """

    def __init__(self, nbytes: int, error: OSError) -> None:
        super().__init__(
            f"{_THROUGH_SHM}, and a segment of {_size(nbytes)} for them could not be made"
            f" ({type(error).__name__}: {error}). Nothing of this call was done: the Metric is as it was before it,"
            f" and its next call tries again. HINT: {_short_of(error)}; or {_NO_SHM}."
        )


def _room() -> tuple[int, int] | None:
    """The bytes free and in all in ``/dev/shm``, or ``None`` where there is none (not Linux)."""
    try:
        stat = os.statvfs(_SHM)
    except OSError:
        return None
    return stat.f_bavail * stat.f_frsize, stat.f_blocks * stat.f_frsize


def _reserve(shm: shared_memory.SharedMemory, room: tuple[int, int] | None) -> None:
    """Take the segment's pages in ``/dev/shm`` now, so that no write into it can fail (another process took room)."""
    path = os.path.join(_SHM, shm.name.lstrip("/"))
    if room is None or not hasattr(os, "posix_fallocate") or not os.path.exists(path):
        return
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError:  # no file descriptor left, say: the segment goes, not to hold its room until the process ends
        _discard(shm)
        raise
    try:
        os.posix_fallocate(fd, 0, shm.size)
    except OSError as error:
        if error.errno not in (errno.ENOSPC, errno.ENOMEM):
            return  # a file system that cannot reserve: written as it comes
        _discard(shm)
        raise _NoRoom(shm.size, _room()) from error
    finally:
        os.close(fd)


def _discard(shm: shared_memory.SharedMemory) -> None:
    """Close a segment just made, and remove its name."""
    with contextlib.suppress(BufferError):
        shm.close()
    shm.unlink()


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**20:,.1f} MiB" if nbytes >= 2**20 else f"{nbytes / 2**10:,.1f} KiB"


_SMALLEST = 16 * 2**20


class _Space:
    """Space in shared memory for the inputs of the updates sent to the worker process, and not answered yet.

    Inputs go into one arena, a ring, at most half full with one update (so that the next update finds room while
    the worker process reads this one); a larger update gets a larger arena, the old one freed once its updates
    have run. Where ``/dev/shm`` has no room for the arena wanted, one as large as the update will do; where it has
    no room for that either, the update is refused before anything is written (``_arena._NoRoom``).

    Args:
        forget: tells the worker process that an arena is gone, and frees it.

    """

    def __init__(self, forget: Callable[[_Arena], None]) -> None:
        self.arena: _Arena | None = None
        # the arena of each update sent and not answered, oldest first (None: its inputs went with the message)
        self.in_flight: deque[_Arena | None] = deque()
        self.capped = False  # whether the arena is as large as /dev/shm allows, not as large as wanted
        self.forget = forget

    def take(self, nbytes: int, wait: Callable[[], None]) -> tuple[_Arena, int]:
        """An arena and the offset of ``nbytes`` in it; ``wait`` (for an answer) while they do not fit."""
        while True:  # the worker process may end in `wait`: its arenas are closed, and a new one is made
            grown = self.arena is not None and self.capped and nbytes <= self.arena.size  # as /dev/shm allows
            if self.arena is None or (nbytes > self.arena.size // 2 and not grown):
                self._new_arena(max(nbytes * 4, self.arena.size * 2 if self.arena else 0), nbytes)
            assert self.arena is not None
            if (offset := self.arena.take(nbytes)) is not None:
                return self.arena, offset
            if not self.in_flight:  # nothing will give space back: a larger arena
                self._new_arena(self.arena.size * 2, nbytes)
                continue
            wait()

    def _new_arena(self, nbytes: int, needed: int) -> None:
        """A new arena of ``nbytes`` (at least 16 MiB), else of the ``needed`` bytes that /dev/shm has room for."""
        try:
            arena, self.capped = self._made(max(nbytes, _SMALLEST)), False
        except _NoRoom:
            if self.arena is not None and self.arena.size >= needed:  # the one there is will do
                self.capped = True
                return
            arena, self.capped = self._made(needed), True  # else it raises, naming /dev/shm, its size and the fix
        old, self.arena = self.arena, arena
        if old is not None and old not in self.in_flight:
            self.forget(old)
        elif old is not None:
            old.retired = True

    def _made(self, nbytes: int) -> _Arena:
        """A new arena, named unlike those the worker process may hold: a name removed (``opened``) may come again."""
        held = {arena.name for arena in (self.arena, *self.in_flight) if arena is not None}
        while (arena := _Arena(nbytes)).name in held:
            arena.close(unlink=True)
        return arena

    def opened(self, name: str) -> None:
        """The worker process opened the arena of that name, which it uses for an update in flight: its name goes."""
        for arena in self.in_flight:
            if arena is not None and arena.name == name:
                arena.unlink()
                return

    def sent(self, arena: _Arena | None) -> None:
        """An update was queued, its inputs in ``arena`` (``None``: with the message)."""
        self.in_flight.append(arena)

    def unsent(self) -> None:
        """The update last queued is taken back, not sent: its space is free again."""
        arena = self.in_flight.pop()
        if arena is not None:
            arena.untake()

    def answered(self) -> None:
        """The oldest update sent has run: its space is free again (and its arena, if retired and empty)."""
        arena = self.in_flight.popleft()
        if arena is not None:
            arena.give_back()
            if arena.retired and not arena.spans:
                self.forget(arena)

    def close(self) -> None:
        """Free every arena (the worker process ended, or this process exits): the next update makes a new one."""
        for arena in {*self.in_flight, self.arena} - {None}:
            arena.close(unlink=True)  # type: ignore[union-attr]
        self.arena, self.in_flight, self.capped = None, deque(), False
