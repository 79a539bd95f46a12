"""Offloaded updates run by a thread of this process: the queue, and the state each update runs in there."""

import functools
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor
from torch.nn import Module

from lightning_store.metrics._offload.caller_state import _CallerState
from lightning_store.metrics._offload.draws import _drawn, _host_states, _Suspect, _trial_draws
from lightning_store.metrics._offload.guard import _WorkerGuard
from lightning_store.metrics._offload.inputs import _land, _start_copies
from lightning_store.metrics._offload.kept_warnings import _KeptWarnings, _users_frame
from lightning_store.metrics._offload.queue import _Failure, _Queue, _wait_for_room
from lightning_store.metrics._offload.thread.worker import _Job, _thread_worker
from lightning_store.metrics._offload.workers import _Inline
from lightning_store.warnings import _warn_once_at


class _ThreadQueue(_Queue):
    """The queue of an object whose updates the process's worker thread runs (``worker="thread"``).

    Shared too by deep copies (``MetricTracker.increment``, ``clone``), which the same thread updates. Pickled as a
    new, empty queue: an unpickled Metric is settled and has none pending.

    Each update runs in the worker with its caller's thread-local torch state (``_thread_state``), under the guard
    that refuses a draw from a global torch generator (``_guard``), its warnings kept (``_warnings``), and
    Python's and NumPy's generators compared around it (``_random``).
    """

    worker = "thread"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.suspect: _Suspect | None = None

    def __deepcopy__(self, memo: dict) -> "_ThreadQueue":
        return self

    def queue_update(self, obj: Module, update: Callable, args: tuple, kwargs: dict) -> None:
        called = time.perf_counter()
        started = _start_copies(args, kwargs)
        self.submit(functools.partial(_run_landed, update, started), obj, called)

    def queue_call(self, obj: Module, method: str, *args: Any) -> None:
        self.submit(functools.partial(getattr(obj._base_class, method), obj, *args))

    def ahead(self) -> bool:
        return bool(self.pending)

    def submit(self, run: Callable[[], Any], obj: Any = None, called: float | None = None) -> None:
        """Queue ``run`` (``obj``'s update) after the calls already queued; first wait while ``max_pending`` wait.

        ``run`` returns the inputs the update ran on, for a trial if Python's or NumPy's generator changed
        meanwhile. Without ``obj``, ``run`` is no update (a collection's copy of its compute groups' states):
        it is queued in the same order, and not numbered. ``called``: the ``perf_counter()`` at the update's call.
        """
        self.report()
        worker = _thread_worker()
        if worker.stopping:  # the process is exiting (an update from another exit handler): it runs here
            with _Inline():
                run()
            return
        state = _CallerState()
        with worker.lock:
            waited = _wait_for_room(self, worker.wait)
            # counted once queued (it may raise: the thread could not start); the lock held, none of it has run yet
            worker.submit(_Job(self, self.queued + 1 if obj is not None else None, run, state, obj))
            self.pending += 1
            if obj is not None:
                self.queued += 1
        if obj is not None and called is not None:
            self._count_call(called, waited)

    def run(self, job: _Job) -> None:
        """Run ``job`` in the worker, unless an earlier update of this queue raised; what it raises is kept."""
        try:
            self._run(job)
        except BaseException as error:  # in the queue's own steps: kept for the caller, and the worker goes on
            if self.failure is None:
                self.failure = _Failure(error, job.number)

    def _run(self, job: _Job) -> None:
        if self.failure is not None:
            self.failure.discarded += job.number is not None
            return
        started = time.thread_time()  # this thread's CPU time: not the time it waited for the interpreter
        before = _host_states() if job.number is not None else None
        inputs, guard = None, None
        kept: list[warnings.WarningMessage] = []
        try:
            with _as_at_the_call(job.state) as (kept, guard):
                inputs = job.run()
        except BaseException as error:  # `SystemExit`, pytest's `Failed` too: the worker thread must go on
            self.failure = _Failure(error, job.number)
        what = f"update #{job.number}" if job.number is not None else "collection's copy of its states"
        self.warnings.extend((what, message) for message in kept)
        if before is not None and job.number is not None and self.suspect is None:
            drawn = _drawn(before, _host_states())
            if drawn and inputs is not None:
                args, kwargs = apply_to_collection(inputs, Tensor, Tensor.clone)  # its own: the Metric may keep them
                self.suspect = _Suspect(job.obj, job.number, args, kwargs, drawn)
        if job.number is not None and guard is not None and self.failure is None:  # its ops' time, and the Python's
            self.payoff.ran(guard.ops_s, max(0.0, time.thread_time() - started - guard.ops_s))

    def settle(self) -> None:
        self._wait()
        self.report()

    def _wait(self) -> None:
        if self.pending:
            worker = _thread_worker()
            with worker.lock:
                while self.pending:
                    worker.wait()

    def _report_more(self) -> None:
        if self.suspect is not None:
            self._try_suspect()

    def _try_suspect(self) -> None:
        """Try the suspect update again on a copy, in the worker, while this thread waits; raise if it draws."""
        suspect, result = self.suspect, []
        assert suspect is not None
        self.suspect = None
        self._wait()  # the copy is made with every update before it run
        worker = _thread_worker()
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


@contextmanager
def _as_at_the_call(state: _CallerState) -> Iterator[tuple[list[warnings.WarningMessage], _WorkerGuard]]:
    """What an update runs under in the worker: its caller's torch state and the guard; its warnings kept.

    Yields the warnings' list and the guard (which times the update's torch ops).
    """
    guard = _WorkerGuard(state.default_dtype)
    with state.applied(), guard, _KeptWarnings() as kept:
        yield kept, guard


def _run_landed(update: Callable, started: tuple[tuple, dict]) -> tuple[tuple, dict]:
    args, kwargs = _land(started)
    update(*args, **kwargs)
    return args, kwargs
