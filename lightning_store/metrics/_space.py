"""The arenas an update's inputs are written into, seen from the parent: the one in use, and those still read."""

from collections import deque
from collections.abc import Callable

from lightning_store.metrics._arena import _Arena, _NoRoom

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
            arena, self.capped = _Arena(max(nbytes, _SMALLEST)), False
        except _NoRoom:
            if self.arena is not None and self.arena.size >= needed:  # the one there is will do
                self.capped = True
                return
            arena, self.capped = _Arena(needed), True  # else it raises, naming /dev/shm, its size and the fix
        old, self.arena = self.arena, arena
        if old is not None and old not in self.in_flight:
            self.forget(old)
        elif old is not None:
            old.retired = True

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
