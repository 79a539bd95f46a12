"""Offloaded updates run by a worker process: the queue of an offloaded object, and the process it sends them to."""

import atexit
import contextlib
import multiprocessing
import os
import pickle
import threading
import warnings
import weakref
from collections import deque
from collections.abc import Callable
from typing import Any

from torch.nn import Module

from lightning_store.metrics import _pickling
from lightning_store.metrics._arena import _Arena
from lightning_store.metrics._guard import _Refused
from lightning_store.metrics._inputs_shared import _Outgoing
from lightning_store.metrics._queue import _Failure, _Queue, _wait_for_room
from lightning_store.metrics._thread_state import _CallerState
from lightning_store.metrics._worker import _Inline

_HINT_LOST = (
    "If it ended at once: it starts as DataLoader workers do with the `spawn` method, so a script that makes an"
    " offloaded Metric guards its code with `if __name__ == '__main__':`."
)


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
        self.id = _worker.new_id(self)
        self.sent = False  # whether the worker process holds a copy of `root` that counts
        self.ahead_there = False  # whether updates ran there since its states were copied back
        self.paths: dict[int, str] = {}  # id of a Module of `root` -> its name in `root`
        self.lost: str | None = None  # why the worker process's copy is gone

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

    def changed(self) -> None:
        self.sent = False

    def queue_update(self, obj: Module, update: Callable, args: tuple, kwargs: dict) -> None:
        self.report()
        if _worker.stopping:  # the process is exiting (an update from another exit handler)
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
        with _worker.lock:
            self._send_root()
            waited = _wait_for_room(self, _worker.receive)
            self.pending += 1
            self.queued += 1
            self.ahead_there = True
            _worker.send_update(self, ("update", self.id, self.queued, path), outgoing, _CallerState())
        self._count_wait(waited)

    def queue_call(self, obj: Module, method: str, *args: Any) -> None:
        with _worker.lock:
            self._send_root()
            self.pending += 1
            _worker.send_call(("call", self.id, self._path(obj), method, args))

    def settle(self) -> None:
        with _worker.lock:
            self._wait()
            if self.ahead_there and self.lost is None:
                _worker.pull(self)
            self.ahead_there = False
            self.sent = False  # read here, it may be changed here: the worker process gets it again
        self.report()

    def _wait(self) -> None:
        with _worker.lock:
            _worker.flush()
            while self.pending and self.lost is None:
                _worker.receive()

    def _report_more(self) -> None:
        if self.lost is not None:
            raise RuntimeError(
                f"{self.name}: {self.lost} The updates it had run since its states were last read here are lost: this"
                " Metric's state lacks them. HINT: `reset()` the Metric to go on from an empty state."
            )

    def _raise_failure(self) -> None:
        self._wait()
        _worker.send(("resume", self.id))  # the worker process runs this object's updates again
        super()._raise_failure()

    def on_done(self, number: int | None, error: Any, kept: list, drawn: list[str], discarded: bool) -> None:
        """An update (``number``) or a call ran in the worker process, or was not run after a failed one."""
        self.pending -= 1
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
            self.failure = _Failure(_Refused(reason, hint), number)

    def _send_root(self) -> None:
        """Send the worker process a copy of ``root``, unless it holds one that counts."""
        if self.lost is not None:
            self.report()
        if self.sent:
            return
        with _Inline():  # pickled as it is here: nothing is pending
            payload = _pickling.dumps(self.root)
        _worker.send(("replace", self.id, payload))
        self.sent = True

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
        # after the worker process was lost, the object here goes on from an empty state
        if self.lost is not None:
            self.lost, self.pending, self.ahead_there, self.sent = None, 0, False, False


def _warning(category: type[Warning], message: Any, filename: str, lineno: int) -> warnings.WarningMessage:
    return warnings.WarningMessage(message, category, filename, lineno)


class _RemoteTraceback(Exception):
    """The traceback of an error in the worker process, as its cause (as ``concurrent.futures`` gives it)."""

    def __str__(self) -> str:
        return str(self.args[0])


def _error(pickled: bytes | None, name: str, text: str, trace: str) -> BaseException:
    """An error the worker process sent: the exception itself if it could be pickled, else a ``RuntimeError``."""
    error: BaseException = RuntimeError(f"{name}: {text}")
    if pickled is not None:
        with contextlib.suppress(Exception):  # a class the worker process had, and this one has not
            error = pickle.loads(pickled)
    error.__cause__ = _RemoteTraceback(f"\n{trace}")
    return error


class _ProcessWorker:
    """The worker process of this process, started at the first update sent to it, for every offloaded object.

    Messages go one way through a pipe, in order: a copy of an object (``replace``), an update (``update``, its
    tensors in a shared arena), a call (``call``), a read (``pull``). The worker process answers updates and calls
    (``done``) and reads (``states``) in the same order; they are taken here whenever this process waits for one,
    or queues an update. An update with inputs on a device is sent once their copies have landed, in order.
    """

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.conn: Any = None
        self.process: Any = None
        self.queues: weakref.WeakValueDictionary[int, _ProcessQueue] = weakref.WeakValueDictionary()
        self.ids = 0
        self.arena: _Arena | None = None
        # the arena of each update sent and not answered, oldest first (None: its inputs went with the message)
        self.in_flight: deque[_Arena | None] = deque()
        self.outbox: deque[tuple[_ProcessQueue, tuple, _Outgoing, _CallerState, _Arena | None]] = deque()
        self.filters: tuple = ()  # the warnings filters the worker process has
        self.state: _CallerState | None = None  # the caller's torch state the worker process has
        self.pulled: dict[int, bytes] = {}
        self.stopping = False

    def new_id(self, queue: _ProcessQueue) -> int:
        self.ids += 1
        self.queues[self.ids] = queue
        weakref.finalize(queue, self._dropped, self.ids)
        return self.ids

    def _dropped(self, queue_id: int) -> None:
        if self.conn is not None and not self.stopping:
            with contextlib.suppress(Exception):  # at exit, say
                self.send(("drop", queue_id))

    def start(self) -> None:
        from lightning_store.metrics._child import _serve

        context = multiprocessing.get_context("spawn")
        self.conn, theirs = context.Pipe()
        self.process = context.Process(target=_serve, args=(theirs,), name="lightning-store-offload", daemon=True)
        self.process.start()
        theirs.close()
        _register_process_hooks()

    def send(self, message: tuple) -> None:
        self.send_bytes(pickle.dumps(message))

    def send_bytes(self, payload: bytes) -> None:
        if self.conn is None:
            self.start()
        try:
            self.conn.send_bytes(payload)
        except (OSError, ValueError):
            self._lost()

    def send_update(self, queue: _ProcessQueue, head: tuple, outgoing: _Outgoing, state: _CallerState) -> None:
        """Take arena space for ``outgoing`` (waiting for answers if need be), write it, send it once it landed."""
        arena: _Arena | None = None
        if outgoing.nbytes:
            arena, offset = self._space(outgoing.nbytes)
            outgoing.place(arena, offset)
        self.in_flight.append(arena)
        self.outbox.append((queue, head, outgoing, state, arena))
        self.flush(wait=False)

    def send_call(self, message: tuple) -> None:
        self.flush()  # after every update queued before it
        self.send(message)

    def flush(self, wait: bool = True) -> None:
        """Send the updates whose inputs have landed, in order (with ``wait``, all of them)."""
        while self.outbox and (wait or self.outbox[0][2].ready()):
            _, head, outgoing, state, arena = self.outbox.popleft()
            if arena is not None:
                outgoing.land(arena)
            filters = tuple(warnings.filters)
            if filters != self.filters:  # the update warns as it would here
                self.send(("filters", [entry for entry in filters if _pickles(entry)]))
                self.filters = filters
            same = state == self.state  # most often: sent once, and the worker process keeps it
            self.state = state
            self.send_bytes(_pickling.dumps((*head, outgoing.inputs, None if same else state)))

    def _space(self, nbytes: int) -> tuple[_Arena, int]:
        if self.arena is None or nbytes > self.arena.size // 2:
            self._new_arena(max(nbytes * 4, self.arena.size * 2 if self.arena else 0))
        assert self.arena is not None
        while (offset := self.arena.take(nbytes)) is None:
            if not self.in_flight:  # nothing will give space back: a larger arena
                self._new_arena(self.arena.size * 2)
                continue
            self.flush()
            self.receive()
        return self.arena, offset

    def _new_arena(self, nbytes: int) -> None:
        old, self.arena = self.arena, _Arena(max(nbytes, 16 * 2**20))
        if old is not None and old not in self.in_flight:
            self._forget(old)
        elif old is not None:
            old.retired = True  # type: ignore[attr-defined]

    def _forget(self, arena: _Arena) -> None:
        self.send(("forget", arena.name))
        arena.close(unlink=True)

    def receive(self) -> None:
        """Wait for the next answer of the worker process, and take it."""
        try:
            message = self.conn.recv()
        except (EOFError, OSError):
            self._lost()
            return
        kind = message[0]
        if kind == "states":
            self.pulled[message[1]] = message[2]
            return
        _, queue_id, number, error, kept, drawn, discarded, spent = message
        if spent:
            arena = self.in_flight.popleft()
            if arena is not None:
                arena.give_back()
                if getattr(arena, "retired", False) and not arena.spans:
                    self._forget(arena)
        queue = self.queues.get(queue_id)
        if queue is not None:
            queue.on_done(number, error, kept, drawn, discarded)

    def pull(self, queue: _ProcessQueue) -> None:
        """Copy the states of the worker process's copy of ``queue.root`` into ``queue.root``."""
        self.send(("pull", queue.id))
        while queue.id not in self.pulled and queue.lost is None:
            self.receive()
        payload = self.pulled.pop(queue.id, None)
        if payload is None or queue.root is None:
            return
        for module, values in zip(queue.root.modules(), pickle.loads(payload), strict=True):
            module.__dict__.update(values)

    def _lost(self) -> None:
        """The worker process ended (killed, out of memory, or it could not start): what it held is lost."""
        if self.process is not None:
            self.process.join(1)
        code = self.process.exitcode if self.process is not None else None
        reason = f"lightning-store's offload worker process ended (exit code {code}). {_HINT_LOST}"
        for queue in list(self.queues.values()):
            if queue.sent or queue.pending:
                queue.lost = reason
                queue.pending = 0
        self.conn, self.process, self.in_flight, self.outbox = None, None, deque(), deque()
        self.filters, self.state = (), None

    def stop(self) -> None:
        """Let the worker process end, dropping the updates it has not run (at exit), and free the arenas."""
        self.stopping = True
        for queue in list(self.queues.values()):
            queue.dropped += queue.pending
            queue.pending = 0
        if self.conn is not None:
            with contextlib.suppress(Exception):  # it ended already
                self.conn.send(("stop",))
            self.process.join(2)
            if self.process.is_alive():
                self.process.terminate()
        for arena in {*self.in_flight, *(arena for *_, arena in self.outbox), self.arena} - {None}:
            arena.close(unlink=True)  # type: ignore[union-attr]
        self.arena = None


def _pickles(obj: Any) -> bool:
    try:
        pickle.dumps(obj)
    except Exception:
        return False
    return True


_worker = _ProcessWorker()
_registered = False


def _fresh_in_child() -> None:
    # a forked process (a DataLoader worker) has no worker process of its own, and the parent's is not its own:
    # an object whose updates ran there, and whose states were not read back, cannot be read here
    global _worker
    old, _worker = _worker, _ProcessWorker()
    for queue in list(old.queues.values()):
        if queue.ahead():
            queue.lost = "It was copied into a forked process (a DataLoader worker, say) while its worker process had"
            queue.lost += " updates this process had not read back."
        queue.sent, queue.pending, queue.ahead_there = False, 0, False
        queue.id = _worker.new_id(queue)
    old.conn = old.process = None  # not ours to close


def _register_process_hooks() -> None:
    global _registered
    if not _registered:
        _registered = True
        os.register_at_fork(after_in_child=_fresh_in_child)
        atexit.register(lambda: _worker.stop())
