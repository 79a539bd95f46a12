"""The worker process of this process, seen from here: started at the first update sent, fed through a pipe."""

import contextlib
import multiprocessing
import os
import pickle
import signal
import threading
import time
import warnings
import weakref
from collections import deque
from collections.abc import Iterator
from typing import Any, NamedTuple, Protocol

from lightning_store.metrics._offload.caller_state import _CallerState
from lightning_store.metrics._offload.process import messages as _messages
from lightning_store.metrics._offload.process import pickling as _pickling
from lightning_store.metrics._offload.process.arena import _Arena, _Space
from lightning_store.metrics._offload.process.ended import _check_main_runs_again, _process_cannot_start, _why_ended
from lightning_store.metrics._offload.process.inputs import _Outgoing
from lightning_store.metrics._offload.process.progress import _Progress
from lightning_store.metrics._offload.workers import _PerProcess


class _Offloaded(Protocol):
    """What the worker process's side here asks of an object's queue (a ``_ProcessQueue``), which writes its own."""

    id: int
    pending: int
    lost: str | None

    def ahead(self) -> bool: ...
    def on_done(self, answer: _messages._Done) -> None: ...
    def on_broken(self, error: tuple) -> None: ...
    def on_pulled(self, payload: bytes | None, error: tuple | None) -> None: ...
    def worker_lost(self, reason: str, hint: str) -> None: ...
    def forked(self, new_id: int) -> None: ...
    def dropped_at_exit(self, count: int = 1) -> None: ...


class _Queued(NamedTuple):
    """An update in the outbox: what it is sent with, once its inputs have landed."""

    head: tuple[int, int, str]  # the object's id, the update's number, its Module's path in the object
    outgoing: _Outgoing
    state: _CallerState  # the caller's torch state at the call
    filters: tuple  # the warnings filters at the call (`_filters`): the update warns as it would have there
    arena: _Arena | None
    inputs: bytes | list  # pickled, or described as plain values (`inputs._Whole`)
    run: int  # the updates of its queue sent at once, at most, and answered at once (`queue._answered_run`)


@contextlib.contextmanager
def _passive_openmp() -> Iterator[None]:
    """The environment a worker process starts with: its OpenMP threads sleep once a parallel op is done.

    By default they spin a while for the next one, and on a machine with few cores took them from the training
    process: a step of small ops beside a binned AUROC offloaded, 2 torch threads on 2 cores, 1.75 times the step
    without the Metric, 1.16 passive. ``OMP_WAIT_POLICY`` set already is kept. This process's own OpenMP read its
    environment when torch was imported, and the variable is set for the start alone.
    """
    if "OMP_WAIT_POLICY" in os.environ:
        yield
        return
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    try:
        yield
    finally:
        os.environ.pop("OMP_WAIT_POLICY", None)


@contextlib.contextmanager
def _ctrl_c_blocked() -> Iterator[None]:
    """Ctrl-C (``SIGINT``) blocked in this thread while it starts a process, which inherits the block.

    Ctrl-C in a terminal interrupts the whole process group. A process started as DataLoader workers are
    (``spawn``) takes seconds to import torch, and interrupted then, it would end with a traceback of its own
    before it could ignore Ctrl-C; started with it blocked, it never gets it: the process that started it does.
    A Ctrl-C sent while this thread starts it reaches this process when the start is done, or through another thread.
    """
    if not hasattr(signal, "pthread_sigmask"):  # no signal masks (Windows): it ignores Ctrl-C once its code runs
        yield
        return
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)


def _filters() -> tuple[int, tuple]:
    """The warnings filters in force, and the list that holds them: sent to the worker process when either changes.

    ``catch_warnings`` (pytest's, say) puts a new list in place, and Python then shows again a warning shown once
    under ``"default"``: the worker process does too when it is sent filters (``child``, ``_Filters``).
    """
    return id(warnings.filters), tuple(warnings.filters)


_LIVENESS_S = 5.0  # as torch's DataLoader: a wait for an answer looks this often whether the worker process lives
_IDLE_S = 10.0  # once every offloaded object is gone, the worker process ends after this (a new one starts if need be)
_ASK = pickle.dumps(_messages._wire(_messages._Ask()))


class _ProcessWorker:
    """The worker process of this process, started at the first update sent to it, for every offloaded object.

    How it starts, is fed, answers, fails and stops: the NOTE in ``workers.py``; its messages: ``messages.py``.
    """

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.conn: Any = None
        self.readable: _messages._Readable | None = None
        self.process: Any = None
        self.queues: weakref.WeakValueDictionary[int, _Offloaded] = weakref.WeakValueDictionary()
        self.ids = 0
        self.space = _Space(self._forget)  # the arenas of the updates' inputs
        self.outbox: deque[_Queued] = deque()
        self.filters: tuple = ()  # the warnings filters the worker process has
        self.state: _CallerState | None = None  # the caller's torch state the worker process has
        self.running = 0  # the updates sent, not answered yet
        self.sent_updates = 0  # the updates sent to this worker process, in all
        self.progress: _Progress | None = None  # how many of them it has run
        self.asked = False  # whether the worker process was asked for an answer since its last one
        self.answer_every = 1  # it answers unasked every `answer_every` updates, as the last message said
        self.pulled: dict[int, tuple[bytes | None, tuple | None]] = {}  # a read's answer: the states, or an error
        self.to_drop: list[int] = []
        self.stopping = False
        self.ready = False  # whether the worker process started (it said so)
        self.waited_for_start = False  # whether `wait_for_room` waited before it had started (the queue asks)
        self.fatal: tuple | None = None  # the error that ended it, as it sent it
        self.generation = 0  # counts the worker processes lost: a message sent to a lost one is sent again

    def new_id(self, queue: _Offloaded) -> int:
        self.ids += 1
        self.queues[self.ids] = queue
        weakref.finalize(queue, self._dropped, self.ids)
        return self.ids

    def _dropped(self, queue_id: int) -> None:
        # a finalizer may run in the middle of a message: the worker process hears of it with the next one
        self.to_drop.append(queue_id)
        if not self._in_use() and self.process is not None and not self.stopping:
            timer = threading.Timer(_IDLE_S, self._end_if_unused)
            timer.daemon = True
            timer.start()

    def _in_use(self) -> bool:
        # the queue whose finalizer runs may still be in `queues`, dead: only the live ones count
        return any(True for _ in self.queues.values())

    def _end_if_unused(self) -> None:
        """End the worker process if no offloaded object is left to use it (its memory goes back)."""
        with self.lock:
            if self._in_use() or self.conn is None or self.stopping:
                return
            conn, process = self.conn, self.process
            self._forget_worker(close=False)
        _end(conn, process, close=True)

    def start(self) -> None:
        """Start the worker process, or raise why it could not start (``_process_cannot_start``), holding nothing of it.

        A start half done would keep the pipe with both of its ends here: a message sent to it would wait forever.
        """
        _check_main_runs_again()
        context = multiprocessing.get_context("spawn")
        try:
            from lightning_store.metrics._offload.process.child import _serve  # its source is read: a file opened

            conn, theirs = context.Pipe()
        except OSError as error:
            raise _process_cannot_start(error) from error
        progress: _Progress | None = None
        try:
            progress = _Progress()
            process = context.Process(
                target=_serve, args=(theirs, progress.name), name="lightning-store-offload", daemon=True
            )
            with _passive_openmp(), _ctrl_c_blocked():
                process.start()
        except BaseException as error:
            conn.close()
            if progress is not None:
                progress.close(unlink=True)
            if isinstance(error, OSError):
                raise _process_cannot_start(error) from error
            raise
        finally:
            theirs.close()
        self.conn, self.readable, self.progress, self.process = conn, _messages._Readable(conn), progress, process
        self.sent_updates = 0
        _PROCESS.started()

    def send(self, message: Any, start: bool = False) -> None:
        """Send ``message`` (one of ``messages``'), as :meth:`send_bytes`, after the updates held (:meth:`flush`)."""
        if self.outbox and self.conn is not None:
            self.flush(wait=False)
        self._send_now(message, start)

    def _send_now(self, message: Any, start: bool = False) -> None:
        self.send_bytes(pickle.dumps(_messages._wire(message)), start)

    def send_bytes(self, payload: bytes, start: bool = False) -> None:
        """Send ``payload``; with ``start`` (an object's copy), to a new worker process if there is none.

        Any other message meant for a worker process that ended is dropped: what it was about is said lost.
        """
        if self.conn is None and not start:
            return
        if self.conn is None:
            self.start()
        try:
            while self.to_drop:  # the copies of objects gone here, which the worker process may free
                self.conn.send_bytes(pickle.dumps(_messages._wire(_messages._Drop(self.to_drop.pop()))))
            self.conn.send_bytes(payload)
        except (OSError, ValueError):
            self._lost()

    def alive(self) -> bool:
        """Whether the worker process is there to be sent an object (if it ended, what it held is said lost)."""
        if self.process is not None and not self.process.is_alive():
            self._lost()
        return self.conn is not None

    def queue_update(
        self, head: tuple[int, int, str], outgoing: _Outgoing, state: _CallerState, name: str, run: int
    ) -> float | None:
        """Take arena space for ``outgoing`` (waiting for answers if need be), write it, and queue it to be sent.

        ``head``: the object's id, the update's number, its Module's path in the object; ``run``: how many of its
        queue's updates go at once (``queue._answered_run``). Its inputs are pickled now:
        an input that cannot go to another process raises here, and nothing is queued. :meth:`flush` sends it, once
        its inputs have landed. Returns how long it waited for space while the worker process had updates to run
        (``None``: it did not), a wait for its pace as one for room in the queue is: at the default ``max_pending``,
        inputs of more than 256 KiB an update fill the arena first. A wait for the answer of updates it has run
        (it answers a run of them at once) is part of the hand-off; one before it started sets ``waited_for_start``.
        """
        arena: _Arena | None = None
        waited: float | None = None

        def wait_for_space() -> None:
            nonlocal waited
            starting = not self.ready
            self.waited_for_start |= starting
            behind = starting or bool(self.outbox) or self.busy()
            started = time.perf_counter()
            try:
                self._wait_for_answer()
            finally:
                if behind:
                    waited = (waited or 0.0) + time.perf_counter() - started

        try:
            if outgoing.nbytes:
                arena, offset = self.space.take(outgoing.nbytes, wait_for_space)
                outgoing.place(arena, offset)
            inputs = outgoing.pickled(name)
        except BaseException:  # not queued (an input that cannot be pickled, no shared memory, Ctrl-C in a wait)
            if arena is not None:
                arena.untake()
            outgoing.release()  # the pinned memory of its device inputs
            raise
        self.space.sent(arena)
        self.outbox.append(_Queued(head, outgoing, state, _filters(), arena, inputs, run))
        return waited

    def unqueue_last(self) -> None:
        """Take back the update last queued, not sent (its object was lost while it waited for space)."""
        queued = self.outbox.pop()
        self.space.unsent()
        queued.outgoing.release()

    def send_call(self, message: Any) -> None:
        self.flush()  # after every update queued before it
        self.send(message)

    def flush(self, wait: bool = True, hold: bool = False) -> None:
        """Send the updates whose inputs have landed, in order, in one message (with ``wait``, all of them).

        With ``hold`` (at an update's call), while the worker process has updates to run, fewer landed updates than
        the run of their queues (``_Queued.run``) are held for the next call, read or wait: one message costs both
        processes a write or a read of the pipe, and the worker process would only queue them.
        """
        if not self.outbox or (hold and len(self.outbox) < self.outbox[0].run and self.busy()):
            return  # fewer than a run queued, landed or not: held without a look at each (a run may be 50)
        landed = 0
        while landed < len(self.outbox) and (wait or self.outbox[landed].outgoing.ready()):
            landed += 1
        if not landed:
            return
        run = min(self.outbox[index].run for index in range(landed))
        if hold and landed < run and self.busy():
            return
        self.answer_every = run
        updates: list[tuple] = []
        for _ in range(landed):
            if self.conn is None:  # the worker process was lost: the updates left are too
                return
            queued = self.outbox.popleft()
            if queued.arena is not None:
                queued.outgoing.land(queued.arena)
            if queued.filters != self.filters:  # the updates before go with the filters before
                self._send_updates(updates)
                updates = []
                self._send_now(_messages._Filters([entry for entry in queued.filters[1] if _pickling.pickles(entry)]))
                self.filters = queued.filters
            same = queued.state == self.state  # most often: sent once, and the worker process keeps it
            self.state = queued.state
            updates.append((*queued.head, queued.inputs, None if same else queued.state))
        self._send_updates(updates)

    def busy(self) -> bool:
        """Whether the worker process has updates sent to it still to run (read in shared memory: no message)."""
        return self.progress is not None and self.progress.read() < self.sent_updates

    def caught_up(self) -> bool:
        """Whether every update queued has run there: none held here, none sent and still to run."""
        return not self.outbox and not self.busy()

    def _send_updates(self, updates: list[tuple]) -> None:
        if updates and self.conn is not None:  # else the worker process was lost, and the updates with it
            self.running += len(updates)
            self.sent_updates += len(updates)
            message = _messages._Updates(updates, self.answer_every)
            self.send_bytes(pickle.dumps(_messages._wire(message), pickle.HIGHEST_PROTOCOL))

    def wait_for_room(self) -> None:
        """Send the updates held, and wait for the next answer: an update's call whose queue is full.

        Before the worker process has said it started, the call waits for its start (``waited_for_start``).
        """
        self.waited_for_start |= not self.ready
        self.flush(wait=False)
        if not self.running:  # what is pending waits for its device copies: they are waited for
            self.flush()
        self.receive()

    def _wait_for_answer(self) -> None:
        self.flush()
        self.receive()

    def _forget(self, arena: _Arena) -> None:
        self.send(_messages._Forget(arena.name))
        arena.close(unlink=True)

    def receive(self) -> None:
        """Wait for the next answer of the worker process, and take it; looking every few seconds that it lives.

        The worker process answers every ``answer_every`` updates run (as the last message of updates said), and
        the rest once asked (``_Ask``): it is asked here, once an answer, if none waits and fewer updates than that
        are unanswered.
        """
        try:
            if 0 < self.running < self.answer_every and not self.asked and not self._answered(0):
                self.asked = True
                self.send_bytes(_ASK)
            while not self._answered(_LIVENESS_S):
                if not self.process.is_alive() and not self._answered(0):
                    raise EOFError  # its end of the pipe lives on in a fork of this process, say
            message = _messages._read(self.conn.recv())
        except (EOFError, OSError, AttributeError):  # ended, or lost already (no pipe)
            self._lost()
            return
        self._take(message)

    def _answered(self, timeout_s: float) -> bool:
        """Whether an answer waits to be read, waiting at most ``timeout_s``; ``OSError`` if there is no pipe."""
        if self.readable is None:
            raise OSError("no worker process")
        return self.readable(timeout_s)

    def _take(self, message: Any) -> None:
        match message:
            case _messages._Ran(done):
                self.asked = False
                for answer in map(_messages._Done._make, done):
                    if answer.spent:  # an update's
                        self.space.answered()
                        self.running -= 1
                    queue = self.queues.get(answer.object_id)
                    if queue is not None:
                        queue.on_done(answer)
            case _messages._States(queue_id, payload, error):
                self.pulled[queue_id] = (payload, error)
            case _messages._Broken(queue_id, error):
                broken = self.queues.get(queue_id)
                if broken is not None:
                    broken.on_broken(error)
            case _messages._Ready():
                self.ready = True
                if self.progress is not None:
                    self.progress.unlink()  # the worker process has it open
            case _messages._Opened(name):
                self.space.opened(name)
            case _messages._Fatal(error):
                self.fatal = error

    def receive_ready(self) -> None:
        """Take the answers the worker process has sent, without waiting for more."""
        try:
            while self.conn is not None and self._answered(0):
                self.receive()
        except (OSError, ValueError):
            self._lost()

    def pull(self, queue: _Offloaded) -> None:
        """Copy the states of the worker process's copy of ``queue.root`` into ``queue.root`` (the queue does)."""
        self.pulled.pop(queue.id, None)
        self.send(_messages._Pull(queue.id))
        while queue.id not in self.pulled and queue.lost is None:
            self.receive()
        queue.on_pulled(*self.pulled.pop(queue.id, (None, None)))

    def _lost(self) -> None:
        """The worker process ended (killed, out of memory, or it could not start): each queue is told why."""
        with contextlib.suppress(EOFError, OSError, AttributeError):
            while self._answered(0):
                self._take(_messages._read(self.conn.recv()))
        if self.process is not None:
            self.process.join(1)
        code = self.process.exitcode if self.process is not None else None
        reason, hint = _why_ended(code, self.ready, self.fatal)
        for queue in list(self.queues.values()):
            queue.worker_lost(reason, hint)
        self._forget_worker()

    def _forget_worker(self, close: bool = True) -> None:
        """Start afresh at the next message: no worker process, no arena, nothing sent (the pipe closed)."""
        for queued in self.outbox:
            queued.outgoing.release()
        self.space.close()
        if self.progress is not None:
            self.progress.close(unlink=True)
        if self.conn is not None and close:
            with contextlib.suppress(OSError):
                self.conn.close()
        self.conn, self.readable, self.process, self.outbox, self.progress = None, None, None, deque(), None
        self.filters, self.state, self.ready, self.fatal, self.pulled = (), None, False, None, {}
        self.running, self.asked = 0, False
        self.generation += 1

    def stop(self) -> None:
        """Let the worker process end, dropping the updates it has not run (at exit), and free the arenas."""
        self.stopping = True
        for queue in list(self.queues.values()):
            queue.dropped_at_exit(queue.pending)
        if self.conn is not None:
            _end(self.conn, self.process)
        self.space.close()  # the outbox's arenas are in flight
        if self.progress is not None:
            self.progress.close(unlink=True)


def _end(conn: Any, process: Any, close: bool = False) -> None:
    """Tell the worker process to stop, and give it two seconds before it is terminated; ``close`` the pipe."""
    with contextlib.suppress(OSError, ValueError):  # it ended already
        conn.send(_messages._wire(_messages._Stop()))
    if close:
        with contextlib.suppress(OSError):
            conn.close()
    process.join(2)
    if process.is_alive():
        process.terminate()


def _in_child(old: _ProcessWorker, new: _ProcessWorker) -> None:
    """In a forked process (a DataLoader worker), whose worker process is not the parent's: its queues go to ``new``."""
    for queue in list(old.queues.values()):
        queue.forked(new.new_id(queue))
    old.conn = old.process = None  # not ours to close


_PROCESS = _PerProcess(_ProcessWorker, _ProcessWorker.stop, in_child=_in_child)


def _process_worker() -> _ProcessWorker:
    """The worker process of this process, as seen from here."""
    return _PROCESS.get()
