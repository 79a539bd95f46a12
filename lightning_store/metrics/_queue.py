"""The queue of one offloaded Metric (and every Metric inside it): bounded, in order, its first error kept."""

import time
from collections.abc import Callable
from typing import Any

from lightning_store.metrics._worker import _get_worker, _Inline, _Job

DEFAULT_MAX_PENDING = 8


class _Failure:
    """The error an update raised in the worker, kept to be raised again in the caller's thread."""

    __slots__ = ("discarded", "error", "number")

    def __init__(self, error: BaseException, number: int) -> None:
        self.error = error
        self.number = number
        self.discarded = 0  # the updates queued after it, not run


class _UpdateQueue:
    """The updates of one offloaded object waiting for the worker, at most ``max_pending`` at a time.

    Shared by the Metrics configured together (a collection and its Metrics, a wrapper and the Metrics it holds)
    and by their deep copies (``MetricTracker.increment``, ``clone``), so that a read of any of them sees every
    update queued before it. Pickled as a new, empty queue: an unpickled Metric is settled and has none pending.

    After an update raises, the updates queued behind it are not run: the error is raised again at the caller's
    next call on any of these Metrics, saying how many were not run, and the queue then runs new updates again.
    That is what the plain Metric gives: its ``update`` raises, and the calls after it in the caller's code do not
    happen. The Metric's state is the plain one after a failed update (torchmetrics counts it, and keeps what it
    changed before it raised).
    """

    def __init__(self, max_pending: int = DEFAULT_MAX_PENDING, name: str = "Metric") -> None:
        self.max_pending = max_pending
        self.name = name
        self.pending = 0
        self.queued = 0
        self.waits = 0
        self.waited_s = 0.0
        self.failure: _Failure | None = None
        self.dropped = 0  # updates not run, dropped when the process began to exit
        self.probed = False  # whether the first update was checked for random numbers

    def __deepcopy__(self, memo: dict) -> "_UpdateQueue":
        return self

    def __reduce__(self) -> tuple[Any, ...]:
        return _UpdateQueue, (self.max_pending, self.name)

    def submit(self, run: Callable[[], None]) -> None:
        """Queue ``run`` after the updates already queued, first waiting while ``max_pending`` of them wait."""
        self.raise_failure()
        worker = _get_worker()
        if worker.stopping:  # the process is exiting (an update from another exit handler): it runs here
            with _Inline():
                run()
            return
        with worker.lock:
            if self.pending >= self.max_pending:
                started = time.perf_counter()
                while self.pending >= self.max_pending:
                    worker.changed.wait()
                self.waits += 1
                self.waited_s += time.perf_counter() - started
            self.pending += 1
            self.queued += 1
            worker.submit(_Job(self, self.queued, run))

    def run(self, job: _Job) -> None:
        """Run ``job`` in the worker, unless an earlier update of this queue raised."""
        if self.failure is not None:
            self.failure.discarded += 1
            return
        try:
            job.run()
        except Exception as error:
            self.failure = _Failure(error, job.number)

    def settle(self) -> None:
        """Wait until every queued update has run; then raise the error one of them raised, if any."""
        if self.pending:
            worker = _get_worker()
            with worker.lock:
                while self.pending:
                    worker.changed.wait()
        self.raise_failure()

    def raise_failure(self) -> None:
        if self.dropped:
            dropped, self.dropped = self.dropped, 0
            raise RuntimeError(
                f"{self.name}: {dropped} update(s) were still queued when the process began to exit, and were"
                " dropped: this Metric's state lacks them. HINT: read the Metric (`compute()`) before the process"
                " exits, not from an exit handler."
            )
        failure = self.failure
        if failure is None:
            return
        if self.pending:  # the count of updates not run is final once none is pending
            self.settle()
            return
        self.failure = None
        error = failure.error
        not_run = (
            f" The {failure.discarded} update(s) queued after it were not run, as the calls after a raising `update`"
            " would not have been."
            if failure.discarded
            else ""
        )
        message = (
            f"{self.name}.update raised in lightning-store's offload worker, at update #{failure.number} since"
            f" offload_to_cpu: {error}.{not_run} The Metric's state is that after the failed update, as for the"
            " plain Metric; new updates run again."
        )
        try:
            again = type(error)(message)
        except Exception:  # an exception class that takes other arguments: raised as it was
            raise error from None
        raise again from error
