"""What both kinds of offload worker share: one of each per process, made afresh in a fork, stopped at exit."""

import atexit
import os
import threading
from collections.abc import Callable
from typing import Any, Generic, TypeVar

_W = TypeVar("_W")

_local = threading.local()  # `inline`: this thread runs a Metric's own methods directly (the worker, a `forward`)


def _runs_inline() -> bool:
    """Whether this thread runs an offloaded Metric's methods directly, rather than queueing or waiting."""
    return getattr(_local, "inline", 0) > 0


class _Inline:
    """``with _Inline():`` runs an offloaded Metric's methods directly in this thread (its ``forward``)."""

    def __enter__(self) -> None:
        _local.inline = getattr(_local, "inline", 0) + 1

    def __exit__(self, *exc: Any) -> None:
        _local.inline -= 1


class _PerProcess(Generic[_W]):
    """The one worker of a kind in this process: made at first use, made afresh in a forked child, stopped at exit.

    See the NOTE above. ``before_fork`` runs in the parent before a fork; ``in_child`` runs in the child after it,
    with the parent's worker and the child's new one. What a fork and the exit do is registered once, when a worker
    first starts (:meth:`started`), never at import.
    """

    def __init__(
        self,
        make: Callable[[], _W],
        stop: Callable[[_W], None],
        before_fork: Callable[[_W], None] | None = None,
        in_child: Callable[[_W, _W], None] | None = None,
    ) -> None:
        self._make = make
        self._stop = stop
        self._before_fork = before_fork
        self._in_child = in_child
        self._lock = threading.Lock()
        self._worker: _W | None = None
        self.registered = False

    def get(self) -> _W:
        """The worker of this process (made now if there is none yet: it starts at its first job)."""
        worker = self._worker
        if worker is None:
            with self._lock:
                if self._worker is None:
                    self._worker = self._make()
                worker = self._worker
        return worker

    def started(self) -> None:
        """Register, once and only when a worker first starts, what a fork and the process's exit must do."""
        if not self.registered:
            self.registered = True
            if self._before_fork is not None:
                os.register_at_fork(before=self._on_fork)
            os.register_at_fork(after_in_child=self._on_forked)
            atexit.register(self._on_exit)

    def _on_fork(self) -> None:
        if self._before_fork is not None and self._worker is not None:
            self._before_fork(self._worker)

    def _on_forked(self) -> None:
        # the parent's worker is not the child's (its thread does not exist here, its lock may have been held): a
        # worker of the child's own
        self._lock = threading.Lock()
        old, self._worker = self._worker, self._make()
        if self._in_child is not None and old is not None:
            self._in_child(old, self._worker)

    def _on_exit(self) -> None:
        if self._worker is not None:
            self._stop(self._worker)
