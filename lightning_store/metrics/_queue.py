"""The queue of one offloaded Metric (and every Metric inside it): bounded, in order, its errors and warnings kept."""

import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor

from lightning_store.metrics._guard import _Refused, _WorkerGuard
from lightning_store.metrics._lag import _Lag
from lightning_store.metrics._random import _drawn, _host_states, _Suspect, _trial_draws
from lightning_store.metrics._thread_state import _CallerState
from lightning_store.metrics._warnings import _kept_warnings, _users_frame, _warn_again
from lightning_store.metrics._worker import _get_worker, _Inline, _Job
from lightning_store.warnings import _warn_once_at

DEFAULT_MAX_PENDING = 8


class _Failure:
    """The error an update raised in the worker, kept to be raised again in the caller's thread."""

    __slots__ = ("discarded", "error", "number")

    def __init__(self, error: BaseException, number: int | None) -> None:
        self.error = error
        self.number = number  # the update's, or None for another step of the queue
        self.discarded = 0  # the updates queued after it, not run


class _UpdateQueue:
    """The updates of one offloaded object waiting for the worker, at most ``max_pending`` at a time.

    Shared by the Metrics configured together (a collection and its Metrics, a wrapper and the Metrics it holds)
    and by their deep copies (``MetricTracker.increment``, ``clone``), so that a read of any of them sees every
    update queued before it. Pickled as a new, empty queue: an unpickled Metric is settled and has none pending.

    Each update runs in the worker with its caller's thread-local torch state (``_thread_state``), under the guard
    that refuses a draw from a global torch generator (``_guard``), its warnings kept (``_warnings``), and
    Python's and NumPy's generators compared around it (``_random``). What it raised, warned or drew comes back
    at the caller's next call on any of these Metrics: the warnings given again, then the error raised.

    After an update raises, the updates queued behind it are not run: the error says how many, and the queue then
    runs new updates again. That is what the plain Metric gives: its ``update`` raises, and the calls after it in
    the caller's code do not happen. The Metric's state is the plain one after a failed update (torchmetrics
    counts it, and keeps what it changed before it raised).
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
        self.warnings: list[tuple[str, warnings.WarningMessage]] = []
        self.suspect: _Suspect | None = None
        self.lag = _Lag()

    def __deepcopy__(self, memo: dict) -> "_UpdateQueue":
        return self

    def __reduce__(self) -> tuple[Any, ...]:
        return _UpdateQueue, (self.max_pending, self.name)

    def submit(self, run: Callable[[], Any], obj: Any = None) -> None:
        """Queue ``run`` (``obj``'s update) after the calls already queued; first wait while ``max_pending`` wait.

        ``run`` returns the inputs the update ran on, for a trial if Python's or NumPy's generator changed
        meanwhile. Without ``obj``, ``run`` is no update (a collection's copy of its compute groups' states):
        it is queued in the same order, and not numbered.
        """
        self.report()
        worker = _get_worker()
        if worker.stopping:  # the process is exiting (an update from another exit handler): it runs here
            with _Inline():
                run()
            return
        state, waited = _CallerState(), None
        with worker.lock:
            if self.pending >= self.max_pending:
                started = time.perf_counter()
                while self.pending >= self.max_pending:
                    worker.changed.wait()
                waited = time.perf_counter() - started
                self.waits += 1
                self.waited_s += waited
            self.pending += 1
            if obj is not None:
                self.queued += 1
            worker.submit(_Job(self, self.queued if obj is not None else None, run, state, obj))
        if obj is not None:
            message = self.lag.count(waited, self.name, self.max_pending)
            if message is not None:
                frame = _users_frame()
                _warn_once_at(message, frame.f_code.co_filename, frame.f_lineno)

    def run(self, job: _Job) -> None:
        """Run ``job`` in the worker, unless an earlier update of this queue raised."""
        if self.failure is not None:
            self.failure.discarded += job.number is not None
            return
        before = _host_states() if job.number is not None else None
        inputs, kept = None, []
        try:
            with _as_at_the_call(job.state) as kept:
                inputs = job.run()
        except Exception as error:
            self.failure = _Failure(error, job.number)
        what = f"update #{job.number}" if job.number is not None else "collection's copy of its states"
        self.warnings.extend((what, message) for message in kept)
        if before is not None and job.number is not None and self.suspect is None:
            drawn = _drawn(before, _host_states())
            if drawn and inputs is not None:
                args, kwargs = apply_to_collection(inputs, Tensor, Tensor.clone)  # its own: the Metric may keep them
                self.suspect = _Suspect(job.obj, job.number, args, kwargs, drawn)

    def settle(self) -> None:
        """Wait until every queued update has run; then report what they raised, warned or drew."""
        self._wait()
        self.report()

    def _wait(self) -> None:
        if self.pending:
            worker = _get_worker()
            with worker.lock:
                while self.pending:
                    worker.changed.wait()

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
        if self.suspect is not None:
            self._try_suspect()
        if self.failure is not None:
            self._raise_failure()

    def _try_suspect(self) -> None:
        """Try the suspect update again on a copy, in the worker, while this thread waits; raise if it draws."""
        suspect, result = self.suspect, []
        assert suspect is not None
        self.suspect = None
        self._wait()  # the copy is made with every update before it run
        worker = _get_worker()
        with worker.lock:
            self.pending += 1
            worker.submit(_Job(self, None, lambda: result.append(_trial_draws(suspect)), _CallerState(), None))
        self._wait()
        drawn = result[0] if result else []
        if drawn is None:
            frame = _users_frame()
            _warn_once_at(
                f"{self.name}: Python's or NumPy's global generator was drawn from while its update #"
                f"{suspect.number} ran in lightning-store's offload worker, by it or by another thread, and the"
                " Metric cannot be copied to try which. If it was the update, its values and your program's random"
                " numbers differ from a plain run's. HINT: keep this Metric as it is (not offloaded) if its update"
                " draws random numbers.",
                frame.f_code.co_filename,
                frame.f_lineno,
            )
        elif drawn:
            raise RuntimeError(
                f"{self.name}.update drew random numbers from {' and '.join(drawn)} global generator, at update"
                f" #{suspect.number} since offload_to_cpu, in lightning-store's offload worker. Run in the"
                " background, it draws them at another time than the plain Metric, changing both its values and"
                " the random numbers your program draws. This is seen only after the update ran: its draws are"
                " made. HINT: keep this Metric as it is (not offloaded), or give its update a generator of its own"
                " (`random.Random(seed)`, `np.random.default_rng(seed)`)."
            )

    def _raise_failure(self) -> None:
        failure = self.failure
        assert failure is not None
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
        where = (
            f"{self.name}.update raised in lightning-store's offload worker, at update #{failure.number} since"
            " offload_to_cpu"
            if failure.number is not None
            else f"{self.name}'s copy of its compute groups' states raised in lightning-store's offload worker"
        )
        if isinstance(error, _Refused):
            raise RuntimeError(
                f"{where}: {error.reason} The Metric's state holds what the update changed before it.{not_run}"
                f" HINT: {error.hint}"
            ) from error
        message = (
            f"{where}: {_sentence(str(error))}{not_run} The Metric's state is that after the failed update, as for"
            " the plain Metric; new updates run again."
        )
        try:
            again = type(error)(message)
        except Exception:  # an exception class that takes other arguments: raised as it was
            raise error from None
        raise again from error


@contextmanager
def _as_at_the_call(state: _CallerState) -> Iterator[list[warnings.WarningMessage]]:
    """What an update runs under in the worker: its caller's torch state and the guard; its warnings kept (yielded)."""
    with state.applied(), _WorkerGuard(state.default_dtype), _kept_warnings() as kept:
        yield kept


def _sentence(text: str) -> str:
    """``text`` ending as a sentence, with one full stop."""
    text = text.rstrip()
    return text if text.endswith((".", "!", "?")) else f"{text}."
