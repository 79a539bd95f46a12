"""The one background thread per process that runs offloaded Metrics' updates, in the order they were called."""

import threading
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

from lightning_store.metrics._offload.kept_warnings import _install, _uninstall
from lightning_store.metrics._offload.queue import _answered_run
from lightning_store.metrics._offload.workers import _cannot_start, _local, _PerProcess


class _JobsQueue(Protocol):
    """What the worker thread asks of a job's queue (a ``_ThreadQueue``), which alone writes its counts."""

    max_pending: int

    def run(self, job: "_Job") -> None: ...

    def ran(self) -> None: ...

    def dropped_at_exit(self, count: int = 1) -> None: ...


class _Job:
    """One queued call on a Metric's queue: ``run()`` in the worker, with its caller's torch ``state``.

    An update (of ``obj``) is numbered in its queue's order; another step of the queue has no number.
    """

    __slots__ = ("number", "obj", "queue", "run", "state")

    def __init__(self, queue: _JobsQueue, number: int | None, run: Callable[[], Any], state: Any, obj: Any) -> None:
        self.queue = queue
        self.number = number
        self.run = run
        self.state = state
        self.obj = obj


class _WorkerThread:
    """A daemon thread started at the first job, with one FIFO for every offloaded Metric of the process.

    ``lock`` guards the FIFO and every queue's counts; ``changed`` is notified when a job is queued or done. How it
    starts, runs, fails and stops (at a fork, at exit): the NOTE in ``workers.py``.
    """

    # at exit, how long the update the thread runs has to end: the process aborts at its end (`terminate called`)
    # with the thread still in torch code, and a first update may take seconds (torch's dispatch modes import)
    exit_timeout_s = 10.0
    liveness_s = 5.0  # as torch's DataLoader: a wait for the thread looks this often whether it still runs

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.changed = threading.Condition(self.lock)
        self.jobs: deque[_Job] = deque()
        self.thread: threading.Thread | None = None
        self.busy = False
        self.stopping = False

    def submit(self, job: _Job) -> None:
        """Queue ``job``; the caller holds ``lock`` and has counted it as pending on its queue."""
        if self.thread is None:
            _THREAD.started()
            _install()  # a warning an update gives in the thread is kept for its caller
            thread = threading.Thread(target=self._loop, name="lightning-store-offload", daemon=True)
            try:
                thread.start()
            except RuntimeError as error:  # "can't start new thread": kept, it would be taken for one that ended
                raise _cannot_start(
                    "thread",
                    str(error),
                    "the system is short of memory or of threads: free memory, or end threads or processes; or keep"
                    " the Metric as it is (not offloaded)",
                ) from error
            self.thread = thread
        self.jobs.append(job)
        self.changed.notify_all()

    def wait(self) -> None:
        """Wait (holding ``lock``) until a job is done; raise if the thread ended with jobs left, rather than hang."""
        if self.changed.wait(self.liveness_s) or self.thread is None or self.thread.is_alive():
            return
        if self.jobs or self.busy:
            raise RuntimeError(
                f"lightning-store's offload worker thread ended with {len(self.jobs) + self.busy} job(s) not run: the"
                " offloaded Metrics' states lack them. HINT: this is a bug of lightning-store, please report it; pass"
                " worker='process' to offload_to_cpu meanwhile."
            )

    def is_worker_thread(self) -> bool:
        return self.thread is not None and threading.get_ident() == self.thread.ident

    def _loop(self) -> None:
        _local.inline = 1
        unsaid = 0  # jobs run since the callers waiting were last woken
        while True:
            with self.lock:
                while not self.jobs and not self.stopping:
                    self.changed.wait()
                if self.stopping:
                    return
                job = self.jobs.popleft()
                self.busy = True
            try:
                job.queue.run(job)  # what it raises is kept for the caller
            finally:
                with self.lock:
                    self.busy = False
                    job.queue.ran()
                    unsaid += 1
                    # a caller woken takes the interpreter lock from the updates run here: woken once half its
                    # queue's room has run (room for as many), or when there is nothing left to run
                    if unsaid >= _answered_run(job.queue.max_pending) or not self.jobs:
                        unsaid = 0
                        self.changed.notify_all()

    def quiesce(self) -> None:
        """Wait until every queued job has run (before a fork)."""
        if self.thread is None or self.is_worker_thread():
            return
        with self.lock:
            while self.jobs or self.busy:
                self.wait()

    def stop(self) -> None:
        """Drop the jobs not yet run and let the thread end (at exit)."""
        with self.lock:
            for job in self.jobs:
                job.queue.dropped_at_exit()
            self.jobs.clear()
            self.stopping = True
            self.changed.notify_all()
            thread = self.thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(self.exit_timeout_s)
        _uninstall()


_THREAD = _PerProcess(_WorkerThread, _WorkerThread.stop, before_fork=_WorkerThread.quiesce)


def _thread_worker() -> _WorkerThread:
    """The worker thread of this process."""
    return _THREAD.get()
