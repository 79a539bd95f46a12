"""What both kinds of offload worker share: one of each per process, made afresh in a fork, stopped at exit."""

import atexit
import errno
import os
import threading
from collections.abc import Callable
from typing import Any, Generic, TypeVar

_W = TypeVar("_W")

# NOTE [ Offload workers: start, feed, answer, fail, stop ]
#
# Each process has at most one worker of each kind, for every Metric offloaded with it, held by a `_PerProcess`:
# a thread of the process (`thread/worker.py`: `_WorkerThread`, its queue `thread/queue.py: _ThreadQueue`) or a
# process of its own (`process/parent.py`: `_ProcessWorker` here, `process/child.py: _ChildServer` there, their
# messages in `process/messages.py`, the queue `process/queue.py: _ProcessQueue`). The queue (`queue.py: _Queue`)
# alone writes its counts (`pending`, `dropped`, `lost`, ...): the workers call its methods.
#
# Start. Lazily, never at import. The thread starts at the first job queued (`_WorkerThread.submit`), which
# routes warnings so that those of the updates are kept (`kept_warnings._install`). The worker process starts
# when the first copy of an offloaded object is sent to it, before its first update: `_check_main_runs_again`
# first (the `spawn` method, as DataLoader workers, runs `__main__` again: not from stdin, and not the statement
# running now, unless `if __name__ == "__main__":` guards it), then a daemon process that says
# `_Ready`. What a fork and the exit do (below) is registered when the first worker of a kind starts.
#
# Feed. Thread: a FIFO of `_Job`s under the worker's lock, each with its caller's torch state (`_CallerState`) and
# its inputs' copies to the CPU started, not waited for; the caller waits only while `max_pending` updates of its
# queue wait (`queue._wait_for_room`, counted by its `_Lag`). Process: the object is sent whole (`_Replace`)
# before its first update and after each read here; an update's tensors get space in a shared-memory arena
# (`arena._Space`), its inputs are pickled at the call (an input that cannot be pickled raises there; whole CPU
# tensors alone go as plain values, `inputs._Whole`), and it waits in the outbox until its device copies have
# landed (`_ProcessWorker.flush`), then goes in order through the pipe (`_Updates`: while the worker process has
# updates to run, which a counter in shared memory tells, `progress._Progress`, a run of landed ones,
# `queue._answered_run`, goes as one message, and any other message after them), each with the warnings filters
# and the torch state of its call, sent only when they changed. The worker process runs a message's updates of
# one object that follow one another as a row (`_ChildServer._run_row`), the global generators compared around
# the row; its OpenMP threads sleep between parallel ops (`parent._passive_openmp`).
#
# Answer. Thread: after each job, the worker counts it run (`_Queue.ran`, one less pending), and wakes the waiters
# once a run of jobs has run (`queue._answered_run`) or none is left. Process: the worker process answers the
# updates and calls it ran (`_Ran`, a `_Done` each, which also frees its arena space: one answer after a row with
# a failure, a draw or a warning, after a run of updates, and when asked, `_Ask`, by a wait here)
# and each read (`_States`), in order: a small answer written at once, a larger one, or one the pipe has no room
# for, by a thread of its own (`answers.py`); this process takes the answers only when it waits for one
# (`receive`) or queues an update (`receive_ready`). A read waits until nothing is pending (`settle`), and a
# worker process's copy sends its states back (`_Pull`), which the queue copies into the object here.
#
# Fail. What an update raises is kept by its queue as a `_Failure` (from a worker process, sent back pickled, with
# its traceback as the cause) and raised in the caller's thread at its next call on any of the Metrics, after the
# warnings given again; the updates queued behind it are not run, and said so (the worker process resumes the
# object at `_Resume`); an object the worker process cannot make from its copy is said so (`_Broken`), and a draw
# from a global generator is refused. A worker that is gone is seen, as torch's DataLoader does: every wait looks
# each 5 s whether the thread or the process still lives (`liveness_s`, `_LIVENESS_S`), and the worker process
# looks each 5 s whether its parent does (`_WATCH_S`). A lost worker process is said with its exit code or signal
# and the last exception it sent (`ended._why_ended`, from `_Fatal`); an object with updates there not read back
# is lost (its reads raise until `reset()`), any other is sent again, whole, to a new worker process
# (`_ProcessQueue.worker_lost`).
#
# Stop. Before a fork (a DataLoader worker), the thread runs its FIFO to its end; in the child, a new worker of
# each kind started is made, and the objects whose updates ran in the parent's worker process and were not read
# back are lost there (`_ProcessQueue.forked`). At exit, each worker drops the updates not run (counted by the queue,
# `dropped_at_exit`, said at the next read) and ends: the thread once the update it runs has (joined for up to
# 10 s), the worker process told to `_Stop`, then ended if it has not after 2 s; an update made after that runs in
# the caller (`_Inline`). Once no offloaded object is left, the worker process ends 10 s later (`_IDLE_S`): a new
# one starts if need be.


_SHORT_OF = {
    errno.EMFILE: "this process has as many files open as it may: close some, or raise the limit (`ulimit -n`)",
    errno.ENFILE: "the system has as many files open as it may: end what holds them",
    errno.ENOMEM: "the system is short of memory: free some",
    errno.EAGAIN: "the system is short of memory or of processes: free memory, or end processes",
}


def _short_of(error: OSError) -> str:
    """What to do where ``error`` says the process or the system is short of something (files, memory...)."""
    return _SHORT_OF.get(error.errno or 0, "fix what the error names")


def _cannot_start(worker: str, cause: str, hint: str) -> RuntimeError:
    """The error raised at the call whose worker (``"thread"``, ``"process"``) could not start, for ``cause``.

    The worker kept nothing of the start: the call did nothing, and the next one starts a worker again.
    """
    return RuntimeError(
        f"lightning-store's offload worker {worker} could not start ({cause}). Nothing of this call was done: the"
        f" Metric is as it was before it, and its next call starts the worker {worker} again. HINT: {hint}."
    )


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

    See the NOTE above. ``stop`` runs at exit; ``before_fork`` runs in the parent before a fork; ``in_child`` in the
    child after it, with the parent's worker and the child's new one. What a fork and the exit do is registered
    once, when a worker first starts (:meth:`started`), never at import.
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
