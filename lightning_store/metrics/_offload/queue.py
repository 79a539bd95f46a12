"""What every offloaded Metric's queue keeps: its bound, its counts, its lag, and what its updates raised or warned."""

import time
import warnings
from collections.abc import Callable
from typing import Any

from torch.nn import Module

from lightning_store.metrics._offload.guard import _Refused
from lightning_store.metrics._offload.kept_warnings import _users_frame, _warn_again
from lightning_store.metrics._offload.payoff import _Payoff
from lightning_store.warnings import _warn_once_at

# by worker. A worker process's updates wait with their inputs in shared memory of a size of its own (16 MiB, or 4
# times the largest update's inputs), whatever their count: more of them cost no more memory. Each of a worker
# thread's holds a copy of its inputs.
DEFAULT_MAX_PENDING = {"process": 64, "thread": 16}


def _answered_run(max_pending: int) -> int:
    """How many of a queue's updates the worker runs before it wakes a caller waiting for room: half of them.

    A caller woken costs the worker its wake-up (a write to the pipe, from a worker process), and a worker thread
    the interpreter lock the caller then takes; a worker process also sends a queue's updates in messages of as
    many, each a write and a read of the pipe. 2,000 back-to-back updates of a scalar's mean in a worker process,
    at 8 updates a message and an answer (max_pending=16): 10 to 15 µs an update less than at 4; a
    ``MulticlassAccuracy(10)`` of 64, at 16 (max_pending=32): 7 µs less than at 8; at 32 (max_pending=64): 2 to 3 µs
    less than at 16 (at 64: 2 to 3 µs less again, for a read that may wait for twice as many).
    """
    return max(1, max_pending // 2)


class _Failure:
    """The error an update raised in the worker, kept to be raised again in the caller's thread."""

    __slots__ = ("discarded", "error", "number", "since")

    def __init__(self, error: BaseException, number: int | None, since: int | None = None) -> None:
        self.error = error
        self.number = number  # the update's, or None for another step of the queue
        self.since = since  # the first of the updates it may be in, up to `number` (a row checked as one), or None
        self.discarded = 0  # the updates queued after it, not run


class _Queue:
    """The updates of one offloaded object waiting for its worker, at most ``max_pending`` at a time.

    Shared by the Metrics configured together (a collection and its Metrics, a wrapper and the Metrics it holds),
    so that a read of any of them sees every update queued before it. What the updates raised, warned or drew
    comes back at the caller's next call on any of these Metrics: the warnings given again, then the error raised.

    After an update raises, the updates queued behind it are not run: the error says how many, and the queue then
    runs new updates again. That is what the plain Metric gives: its ``update`` raises, and the calls after it in
    the caller's code do not happen. The Metric's state is the plain one after a failed update (torchmetrics
    counts it, and keeps what it changed before it raised).

    A worker is a thread of this process (``thread.queue._ThreadQueue``) or a process of its own
    (``process.queue._ProcessQueue``), which say how an update is queued, run and waited for: the NOTE in
    ``workers.py``. The queue alone writes its counts; its workers call :meth:`ran` and :meth:`dropped_at_exit`.
    """

    worker = ""  # "thread" or "process"

    def __init__(self, max_pending: int, name: str = "Metric") -> None:
        self.max_pending = max_pending
        self.name = name
        self.pending = 0
        self.queued = 0
        self.failure: _Failure | None = None
        self.dropped = 0  # updates not run, dropped when the process began to exit
        self.warnings: list[tuple[str, warnings.WarningMessage]] = []
        self.lag = _Lag()
        self.payoff = _Payoff()

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (self.max_pending, self.name)

    @property
    def waits(self) -> int:
        """How many ``update`` calls waited for the worker (for room in the queue or its shared memory), in all."""
        return self.lag.waits

    @property
    def waited_s(self) -> float:
        """How long, in seconds, ``update`` calls waited for the worker (see :attr:`waits`), in all."""
        return self.lag.waited_s

    def queue_update(self, obj: Module, update: Callable, args: tuple, kwargs: dict) -> None:
        """Queue ``obj``'s ``update`` (its own, unwrapped) on ``args`` and ``kwargs``, taken as they are now."""
        raise NotImplementedError

    def queue_call(self, obj: Module, method: str, *args: Any) -> None:
        """Queue a call of ``obj``'s own ``method`` after the updates queued (a collection's copy of its states)."""
        raise NotImplementedError

    def ahead(self) -> bool:
        """Whether the worker has updates this process's objects do not show yet."""
        raise NotImplementedError

    def waiting(self) -> int:
        """How many of this queue's updates wait for the worker (the bound ``max_pending`` is on these)."""
        return self.pending

    def settle(self) -> None:
        """Wait until every queued update has run and shows here; then report what they raised, warned or drew."""
        raise NotImplementedError

    def resetting(self) -> None:
        """Say that the objects are about to be reset: what their updates were is of no more use."""

    def _wait(self) -> None:
        """Wait until no update is pending."""
        raise NotImplementedError

    def ran(self) -> None:
        """Count a queued update or call as run by the worker (or not run, after a failed one): one less pending."""
        self.pending -= 1

    def dropped_at_exit(self, count: int = 1) -> None:
        """Count ``count`` pending updates or calls as dropped, not run, as the process began to exit."""
        self.pending -= count
        self.dropped += count

    def _count_call(
        self, started: float, waited: float | None, starting: bool = False, for_space: bool = False
    ) -> None:
        """Count an update's call, ``started`` at that ``perf_counter()``, which ``waited`` for room (or did not).

        ``starting``: the call waited for a worker process to start, not for updates (see :meth:`_Lag.count`);
        ``for_space``: it waited for room in a worker process's shared memory for its inputs, not in the queue.
        Said once each: that the worker falls behind (the lag), that offloading costs the step more than it saves.
        """
        handoff_s = time.perf_counter() - started - (waited or 0.0)
        for message in (
            self.lag.count(started, waited, self.name, self.max_pending, starting, for_space),
            self.payoff.called(handoff_s, self.name, self.worker),
        ):
            if message is not None:
                frame = _users_frame()
                _warn_once_at(message, frame.f_code.co_filename, frame.f_lineno)

    def report(self) -> None:
        """Give again the warnings the updates run gave, then raise what one of them raised or drew."""
        if self.warnings:
            kept, self.warnings = self.warnings, []
            for what, message in kept:
                _warn_again(message, f"{self.name}.{what}")
        if self.dropped:
            dropped, self.dropped = self.dropped, 0
            raise RuntimeError(
                f"{self.name}: {dropped} update(s) were still queued when the process began to exit, and were"
                " dropped: this Metric's state lacks them. HINT: read the Metric (`compute()`) before the process"
                " exits, not from an exit handler."
            )
        self._report_more()
        if self.failure is not None:
            self._raise_failure()

    def _report_more(self) -> None:
        """What a kind of worker has to report besides (a draw found after an update, say)."""

    def _raise_failure(self) -> None:
        failure = self.failure
        assert failure is not None
        if self.pending:  # the count of updates not run is final once none is pending
            self._wait()
        self.failure = None
        error = failure.error
        not_run = (
            f" The {failure.discarded} update(s) queued after it were not run, as the calls after a raising `update`"
            " would not have been."
            if failure.discarded
            else ""
        )
        if failure.number is None:
            where = f"{self.name}'s copy of its compute groups' states raised in lightning-store's offload worker"
        elif failure.since is not None:
            where = (
                f"{self.name}.update raised in lightning-store's offload worker, in one of updates #{failure.since}"
                f" to #{failure.number} since offload_to_cpu (run in a row there, and checked together)"
            )
        else:
            where = (
                f"{self.name}.update raised in lightning-store's offload worker, at update #{failure.number} since"
                " offload_to_cpu"
            )
        if isinstance(error, _Refused):
            raise RuntimeError(f"{where}: {error.reason} {error.held}{not_run} HINT: {error.hint}") from error
        message = (
            f"{where}: {_sentence(str(error))}{not_run} The Metric's state is that after the failed update, as for"
            " the plain Metric; new updates run again."
        )
        try:
            again = type(error)(message)
        except Exception:  # an exception class that takes other arguments: raised as it was
            raise error from None
        raise again from error


def _wait_for_room(queue: _Queue, wait: Callable[[], Any], take_done: Callable[[], Any] | None = None) -> float | None:
    """Wait (with ``wait``, which returns when an update has run) while ``max_pending`` updates wait; how long.

    ``take_done`` first takes, without waiting, what says that updates have run (a worker process's answers, read
    only when this process looks): a queue full only until then had room.
    """
    if queue.waiting() >= queue.max_pending and take_done is not None:
        take_done()
    if queue.waiting() < queue.max_pending:
        return None
    started = time.perf_counter()
    while queue.waiting() >= queue.max_pending:
        wait()
    return time.perf_counter() - started


def _sentence(text: str) -> str:
    """``text`` ending as a sentence, with one full stop."""
    text = text.rstrip()
    return text if text.endswith((".", "!", "?")) else f"{text}."


WINDOW = 50  # updates: the worker falls behind when a window's calls waited for room for half its time or more


class _Lag:
    """The calls of one queue that waited for room (``max_pending`` updates already waiting): in all, and by window.

    A call that waits means the worker runs the Metric's updates slower than they come. A caller waiting for room
    is woken once a run of updates has run (half of ``max_pending``), so that few calls wait, however far behind
    the worker is: what tells it is the time they waited. Once the calls of a window (from the first one's start
    to the last one's end) waited for half of its time or more, the worker is behind (``behind``), and
    :meth:`count` returns the message that says so, the first time only. ``waits`` and ``waited_s`` count every
    call that waited since the Metric was offloaded. A call that waited for a worker process to start (its calls
    queued meanwhile) is counted there, not in a window: a new one starts after it.
    """

    __slots__ = (
        "behind",
        "told",
        "waited_s",
        "waits",
        "window_calls",
        "window_for_space",
        "window_started",
        "window_waited_s",
        "window_waits",
    )

    def __init__(self) -> None:
        self.waits = self.window_calls = self.window_waits = 0
        self.waited_s = self.window_waited_s = self.window_started = 0.0
        self.behind = self.told = self.window_for_space = False

    def count(
        self,
        started: float,
        waited_s: float | None,
        name: str,
        max_pending: int,
        starting: bool = False,
        for_space: bool = False,
    ) -> str | None:
        """Count a call ``started`` at that ``perf_counter()``, which ``waited_s`` for room (``None``: it did not).

        ``starting``: it waited for a worker process to start (seconds), with the updates queued meanwhile, which
        says nothing of the worker's pace: counted in all, and a new window starts after it. ``for_space``: it
        waited for room in a worker process's shared memory for its inputs, which a larger ``max_pending`` does not
        make. Returns the message that the worker falls behind, once.
        """
        if waited_s is not None:
            self.waits += 1
            self.waited_s += waited_s
        if starting:
            self._new_window()
            return None
        if self.window_calls == 0:
            self.window_started = started
        self.window_calls += 1
        if waited_s is not None:
            self.window_waits += 1
            self.window_waited_s += waited_s
            self.window_for_space |= for_space
        if self.window_calls < WINDOW:
            return None
        calls, waits, waited_s = self.window_calls, self.window_waits, self.window_waited_s
        for_space = self.window_for_space
        window_s = time.perf_counter() - self.window_started
        self._new_window()
        self.behind = 2 * waited_s >= window_s
        if not self.behind or self.told:
            return None
        self.told = True
        room = "in the queue or in the shared memory its inputs go through" if for_space else "in the queue"
        bursts = (
            ""
            if for_space  # the shared memory holds fewer of these inputs than max_pending
            else f"; if the calls come in bursts, a larger max_pending (now {max_pending}) absorbs them"
        )
        return (
            f"{name}: its offload worker falls behind: `update` waited for room {room} for {waited_s:.3f} s"
            f" of the last {calls} calls' {window_s:.3f} s (at {waits} of them). The step waits for the Metric's"
            " work: it takes about as long as the update does in the worker, and offloading saves it only the time"
            " the two overlap. HINT: update the Metric less often (every few steps), or time the step with the"
            f" Metric kept as it is (not offloaded){bursts}."
        )

    def _new_window(self) -> None:
        self.window_calls = self.window_waits = 0
        self.window_waited_s = 0.0
        self.window_for_space = False
