"""The worker process of this process, seen from here: started at the first update sent, fed through a pipe."""

import atexit
import contextlib
import multiprocessing
import os
import pickle
import threading
import warnings
import weakref
from collections import deque
from typing import TYPE_CHECKING, Any

from lightning_store.metrics import _pickling
from lightning_store.metrics._arena import _Arena
from lightning_store.metrics._inputs_shared import _Outgoing
from lightning_store.metrics._thread_state import _CallerState

if TYPE_CHECKING:
    from lightning_store.metrics._in_process import _ProcessQueue

_HINT_LOST = (
    "If it ended at once: it starts as DataLoader workers do with the `spawn` method, so a script that makes an"
    " offloaded Metric guards its code with `if __name__ == '__main__':`."
)


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
        self.outbox: deque[tuple[tuple, _Outgoing, _CallerState, _Arena | None]] = deque()  # to send, in order
        self.filters: tuple = ()  # the warnings filters the worker process has
        self.state: _CallerState | None = None  # the caller's torch state the worker process has
        self.pulled: dict[int, bytes] = {}
        self.to_drop: list[int] = []
        self.stopping = False

    def new_id(self, queue: "_ProcessQueue") -> int:
        self.ids += 1
        self.queues[self.ids] = queue
        weakref.finalize(queue, self._dropped, self.ids)
        return self.ids

    def _dropped(self, queue_id: int) -> None:
        # a finalizer may run in the middle of a message: the worker process hears of it with the next one
        self.to_drop.append(queue_id)

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
            while self.to_drop:  # the copies of objects gone here, which the worker process may free
                self.conn.send_bytes(pickle.dumps(("drop", self.to_drop.pop())))
            self.conn.send_bytes(payload)
        except (OSError, ValueError):
            self._lost()

    def send_update(self, head: tuple, outgoing: _Outgoing, state: _CallerState) -> None:
        """Take arena space for ``outgoing`` (waiting for answers if need be), write it, send it once it landed."""
        arena: _Arena | None = None
        if outgoing.nbytes:
            arena, offset = self._space(outgoing.nbytes)
            outgoing.place(arena, offset)
        self.in_flight.append(arena)
        self.outbox.append((head, outgoing, state, arena))
        self.flush(wait=False)

    def send_call(self, message: tuple) -> None:
        self.flush()  # after every update queued before it
        self.send(message)

    def flush(self, wait: bool = True) -> None:
        """Send the updates whose inputs have landed, in order (with ``wait``, all of them)."""
        while self.outbox and (wait or self.outbox[0][1].ready()):
            head, outgoing, state, arena = self.outbox.popleft()
            if arena is not None:
                outgoing.land(arena)
            filters = tuple(warnings.filters)
            if filters != self.filters:  # the update warns as it would here
                self.send(("filters", [entry for entry in filters if _pickling.pickles(entry)]))
                self.filters = filters
            same = state == self.state  # most often: sent once, and the worker process keeps it
            self.state = state
            message = (*head, outgoing.inputs, None if same else state)
            # most often no tensor is left in the inputs (they are in the arena, or `_Small`): pickle's own is faster
            self.send_bytes(
                _pickling.dumps(message) if outgoing.tensors else pickle.dumps(message, pickle.HIGHEST_PROTOCOL)
            )

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
            old.retired = True

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
                if arena.retired and not arena.spans:
                    self._forget(arena)
        queue = self.queues.get(queue_id)
        if queue is not None:
            queue.on_done(number, error, kept, drawn, discarded)

    def receive_ready(self) -> None:
        """Take the answers the worker process has sent, without waiting for more."""
        try:
            while self.conn is not None and self.conn.poll():
                self.receive()
        except (OSError, ValueError):
            self._lost()

    def pull(self, queue: "_ProcessQueue") -> None:
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
            with contextlib.suppress(OSError):  # it ended already
                self.conn.send(("stop",))
            self.process.join(2)
            if self.process.is_alive():
                self.process.terminate()
        for arena in {*self.in_flight, *(arena for *_, arena in self.outbox), self.arena} - {None}:
            arena.close(unlink=True)  # type: ignore[union-attr]
        self.arena = None


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
