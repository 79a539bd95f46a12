"""Offloaded updates run by a worker process: the queue of an offloaded object, and what comes back from there."""

import contextlib
import pickle
import time
import warnings
from collections.abc import Callable
from typing import Any, cast

from torch.nn import Module

from lightning_store.metrics._offload.caller_state import _CallerState
from lightning_store.metrics._offload.guard import _Refused
from lightning_store.metrics._offload.process import pickling as _pickling
from lightning_store.metrics._offload.process.defaults import _SentDefaults
from lightning_store.metrics._offload.process.ended import _RESET, _why_not_made
from lightning_store.metrics._offload.process.inputs import _Outgoing
from lightning_store.metrics._offload.process.messages import _Call, _Done, _Replace, _Resume
from lightning_store.metrics._offload.process.parent import _process_worker
from lightning_store.metrics._offload.queue import _answered_run, _Failure, _Queue, _wait_for_room
from lightning_store.metrics._offload.workers import _Inline


class _ProcessQueue(_Queue):
    """The queue of an object whose updates the worker process runs, on a copy of it (``worker="process"``).

    The worker process holds a copy of the object given to ``offload_to_cpu`` (``root``), made from it when its
    first update is sent, and runs the updates on it. A read here first waits for the updates sent, then copies
    the copy's states back (``_ProcessWorker.pull``); the object here is then the one that counts, and the worker
    process gets it again before the next update, as anything may have changed it here.
    """

    worker = "process"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.root: Module | None = None
        self.id = _process_worker().new_id(self)
        self.sent = False  # whether the worker process holds a copy of `root` that counts
        self.ahead_there = False  # whether updates ran there since its states were copied back
        self.paths: dict[int, str] = {}  # id of a Module of `root` -> its name in `root`
        self.lost: str | None = None  # why the worker process's copy is gone
        self.lost_hint = _RESET  # and what to do
        self.defaults: _SentDefaults | None = None  # the defaults the worker process's copy holds, as sent

    def __reduce__(self) -> tuple[Any, ...]:
        # with the object it belongs to, so that an unpickled object sends itself whole (pickle keeps the cycle)
        return type(self), (self.max_pending, self.name), {"root": self.root}

    def __setstate__(self, state: dict) -> None:
        self.root = state["root"]

    def __deepcopy__(self, memo: dict) -> "_ProcessQueue":
        if self.root is not None and id(self.root) in memo:  # the whole object is copied: the copy's own queue
            copied = _ProcessQueue(self.max_pending, self.name)
            copied.root = memo[id(self.root)]
            return copied
        return self  # a Metric copied into the object (`MetricTracker.increment`): it goes to the worker with it

    def ahead(self) -> bool:
        return bool(self.pending) or self.ahead_there

    def waiting(self) -> int:
        # run there but not answered yet (the worker process answers a run of updates at once) waits for nothing
        return 0 if _process_worker().caught_up() else self.pending

    def queue_update(self, obj: Module, update: Callable, args: tuple, kwargs: dict) -> None:
        called = time.perf_counter()
        worker = _process_worker()
        # the answers that arrived: an update that failed is said at this call, as with a thread; and whether the
        # worker process has updates to run (of any Metric), for `flush` to send this one at once if not
        if self.pending or worker.running:
            with worker.lock:
                worker.receive_ready()
        self.report()
        if worker.stopping:  # the process is exiting (an update from another exit handler)
            if self.ahead():
                self.dropped += 1
                self.report()
            with _Inline():
                update(*args, **kwargs)  # here, on the object that counts
            return
        path = self._path(obj)
        if path is None:  # a copy made alone (`clone()`), not part of `root`: an object of its own
            queue = _ProcessQueue(self.max_pending, self.name)
            queue.root = obj
            for module in obj.modules():
                if module.__dict__.get("_offload") is self:
                    module.__dict__["_offload"] = queue
            queue.queue_update(obj, update, args, kwargs)
            return
        outgoing = _Outgoing(args, kwargs)
        with worker.lock:
            self._send_root()
            worker.waited_for_start = False
            waited = _wait_for_room(self, worker.wait_for_room, worker.receive_ready)
            if self.lost is not None:  # lost while it waited
                self.report()
            head = (self.id, self.queued + 1, path)
            generation = worker.generation
            run = _answered_run(self.max_pending)
            for_space = worker.queue_update(head, outgoing, _CallerState(), self.name, run)  # raises: not queued
            starting = worker.waited_for_start
            if worker.generation != generation:  # the worker process ended while it waited
                if self.lost is not None:
                    worker.unqueue_last()
                    self.report()
                try:
                    self._send_root()  # nothing of it was lost: the new worker process gets it before the update
                except BaseException:  # a new one could not start: the call raises, and its update is not sent
                    worker.unqueue_last()
                    raise
            self.pending += 1
            self.queued += 1
            self.ahead_there = True
            worker.flush(wait=False, hold=True)
        if for_space is not None:
            waited = (waited or 0.0) + for_space
        self._count_call(called, waited, starting, for_space is not None)

    def queue_call(self, obj: Module, method: str, *args: Any) -> None:
        worker = _process_worker()
        with worker.lock:
            self._send_root()
            self.pending += 1
            worker.send_call(_Call(self.id, self._path(obj), method, args))

    def settle(self) -> None:
        worker = _process_worker()
        with worker.lock:
            self._wait()
            if self.ahead_there and self.lost is None:
                worker.pull(self)
            self.ahead_there = False
            self.sent = False  # read here, it may be changed here: the worker process gets it again
        self.report()

    def _wait(self) -> None:
        worker = _process_worker()
        with worker.lock:
            worker.flush()
            while self.pending and self.lost is None:
                worker.receive()

    def _report_more(self) -> None:
        if self.lost is None:
            return
        failure, self.failure = self.failure, None
        failed = ""
        if failure is not None:  # what an update raised before: the cause, often (an allocation that failed)
            failed = f" Before that, update #{failure.number} raised {type(failure.error).__name__}: {failure.error}"
            failed = failed if failed.endswith(".") else f"{failed}."
        error = RuntimeError(
            f"{self.name}: {self.lost}{failed} The updates sent to it since this Metric's states were last read"
            f" here are lost: its state lacks them. HINT: {self.lost_hint}"
        )
        if failure is not None:
            raise error from failure.error
        raise error

    def on_broken(self, error: tuple) -> None:
        """The worker process could not make its copy of ``root`` (its class cannot be imported there, say)."""
        reason, hint = _why_not_made(error)
        self.lost, self.lost_hint = reason, f"{hint} Then {_RESET}"
        self.defaults = None  # it holds no copy

    def on_pulled(self, payload: bytes | None, error: tuple | None) -> None:
        """The states the worker process sent back (``payload``), copied into ``root``; or why it could not."""
        if error is not None:
            self._not_pulled(error)
        if payload is None or self.root is None:
            return
        for module, values in zip(self.root.modules(), pickle.loads(payload), strict=True):
            module.__dict__.update(values)

    def _not_pulled(self, error: tuple) -> None:
        # the worker process could not send the states back: what its updates did cannot come here
        _, name, text, _, where = error
        if where:
            self.lost = (
                f"its states could not be copied back from the worker process: an update set {where}, which cannot"
                f" be pickled ({name}: {text})."
            )
            self.lost_hint = (
                "keep only picklable attributes on the Metric (no lock, no open file: make one where it is used),"
                f" or pass worker='thread' to offload_to_cpu. Then {_RESET}"
            )
        else:
            self.lost = f"its states could not be copied back from the worker process ({name}: {text})."
            self.lost_hint = f"give the job more memory, or read the Metric more often; then {_RESET}"

    def _raise_failure(self) -> None:
        self._wait()
        _process_worker().send(_Resume(self.id))  # the worker process runs this object's updates again
        super()._raise_failure()

    def on_done(self, answer: _Done) -> None:
        """An update (``answer.number``) or a call ran in the worker process, or was not run after a failed one."""
        self.ran()
        number, error, kept, drawn, discarded = answer.number, answer.error, answer.kept, answer.drawn, answer.discarded
        if number is not None and not discarded:
            self.payoff.ran(answer.update_s)
        if discarded:
            if self.failure is not None:
                self.failure.discarded += number is not None
            return
        what = f"update #{number}" if number is not None else "collection's copy of its states"
        self.warnings.extend((what, _warning(*kept_one)) for kept_one in kept)
        if error is not None:
            self.failure = _Failure(_error(*error), number)
        elif drawn:
            reason = (
                f"it drew random numbers from {' and '.join(drawn)} global generator in the worker process. Its"
                " values differ from the plain Metric's, which would draw them from this process's generators"
                " (they are not moved: the draw was in the worker process)."
            )
            hint = (
                "keep this Metric as it is (not offloaded), or give its update a generator of its own"
                " (`torch.Generator`, `random.Random(seed)`, `np.random.default_rng(seed)`)."
            )
            updates = "update" if answer.drawn_since is None else "updates"
            held = f"The Metric's state holds what the {updates} changed, draws included."
            self.failure = _Failure(_Refused(reason, hint, held), number, since=answer.drawn_since)

    def worker_lost(self, reason: str, hint: str) -> None:
        """The worker process ended: lost with ``reason`` (and ``hint``) if it had updates not here; nothing sent."""
        if self.ahead():
            self.lost, self.lost_hint = reason, hint
        self.pending, self.sent, self.ahead_there, self.defaults = 0, False, False, None

    def forked(self, new_id: int) -> None:
        """This process is a fork, whose worker process is not the parent's (``new_id``: its id in this one's)."""
        if self.ahead():
            self.lost = (
                "It was copied into a forked process (a DataLoader worker, say) while its worker process had updates"
                " this process had not read back."
            )
        self.sent, self.pending, self.ahead_there, self.defaults = False, 0, False, None
        self.id = new_id

    def _send_root(self) -> None:
        """Send the worker process a copy of ``root``, unless it holds one that counts.

        A worker process that ended since it last answered held nothing that is not here: a new one gets the copy.
        """
        if self.lost is not None:
            self.report()
        worker = _process_worker()
        if self.sent and worker.alive():
            return
        if self.lost is not None:  # it ended with updates of this object
            self.report()
        for _ in range(2):  # once more, to a new worker process, if this one ended before it got it
            generation = worker.generation
            worker.send(_Replace(self.id, self._pickled()), start=True)
            if worker.generation == generation:
                self.sent = True
                self.defaults = _SentDefaults(cast(Module, self.root))
                return
            if self.lost is not None:
                self.report()
        self.lost, self.lost_hint = "lightning-store's offload worker process ended twice as it was sent it.", _RESET
        self.report()

    def _pickled(self) -> bytes:
        """``root`` pickled, the defaults the worker process holds as references to them (see ``defaults.py``)."""
        known = self.defaults.references(cast(Module, self.root)) if self.defaults is not None else None
        try:
            with _Inline():  # pickled as it is here: nothing is pending
                return _pickling.dumps(self.root, known)
        except Exception as error:
            raise TypeError(
                f"{self.name} cannot be pickled any more ({error}), and the worker process gets a copy of it before"
                " an update that follows a read or a change: the update is not queued. An attribute set since"
                " offload_to_cpu holds what pickle cannot take (a lambda, a lock, an open file). HINT: keep only"
                " picklable attributes on the Metric, or pass worker='thread' to offload_to_cpu."
            ) from error

    def _path(self, obj: Module) -> str | None:
        """The name of ``obj`` in ``root`` (``""`` for ``root``), or ``None`` if ``obj`` is not part of it.

        A Module of ``root`` not seen yet (a Metric ``MetricTracker.increment`` added) is not in the worker
        process's copy: it gets ``root`` again.
        """
        if id(obj) not in self.paths and self.root is not None:
            self.paths = {id(module): name for name, module in self.root.named_modules()}
            self.sent = False
        return self.paths.get(id(obj))

    def resetting(self) -> None:
        # after the worker process's copy was lost, the object here goes on from an empty state; the updates still
        # pending are answered (not run) by a worker process that could not make the copy, and counted as they are
        if self.lost is not None:
            self.lost, self.ahead_there, self.sent = None, False, False
            self.lost_hint, self.failure = _RESET, None


def _warning(category: type[Warning], message: Any, filename: str, lineno: int) -> warnings.WarningMessage:
    return warnings.WarningMessage(message, category, filename, lineno)


class _RemoteTraceback(Exception):
    """The traceback of an error in the worker process, as its cause (as ``concurrent.futures`` gives it)."""

    def __str__(self) -> str:
        return str(self.args[0])


def _error(pickled: bytes | None, name: str, text: str, trace: str, where: str = "") -> BaseException:
    """An error the worker process sent: the exception itself if it could be pickled, else a ``RuntimeError``."""
    error: BaseException = RuntimeError(f"{name}: {text}")
    if pickled is not None:
        with contextlib.suppress(Exception):  # a class the worker process had, and this one has not
            error = pickle.loads(pickled)
    error.__cause__ = _RemoteTraceback(f"\n{trace}")
    return error
