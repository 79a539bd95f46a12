"""The worker process: a copy of each object offloaded to it, whose updates it runs in order; it sends their states."""

import contextlib
import functools
import os
import pickle
import signal
import time
import traceback
import warnings
from typing import Any, cast

import torch
from torch.nn import Module

from lightning_store.metrics._offload.draws import _drawn, _host_states, _HostStates
from lightning_store.metrics._offload.front import _queued_update
from lightning_store.metrics._offload.kept_warnings import _install, _KeptWarnings
from lightning_store.metrics._offload.process import pickling as _pickling
from lightning_store.metrics._offload.process.answers import _Answers
from lightning_store.metrics._offload.process.arena import _Arena
from lightning_store.metrics._offload.process.defaults import _changed_defaults, _Held, _held, _made_from
from lightning_store.metrics._offload.process.inputs import _read_inputs, _read_whole
from lightning_store.metrics._offload.process.messages import (
    _Ask,
    _Broken,
    _Call,
    _Drop,
    _Fatal,
    _Filters,
    _Forget,
    _Opened,
    _Pull,
    _Ran,
    _read,
    _Readable,
    _Ready,
    _Replace,
    _Resume,
    _States,
    _Stop,
    _Updates,
)
from lightning_store.metrics._offload.process.progress import _Progress
from lightning_store.metrics._offload.workers import _Inline

_MODULE_OWN = frozenset(vars(Module())) | {"_offload", "_defaults", "_persistent", "_reductions"}
_KEPT_WARNINGS = 20  # at most, by update: the rest are dropped (the answer stays small)
_NOTHING_TO_APPLY = contextlib.nullcontext()  # the caller's state in force already (one made for every update: 0.3 µs)
_WATCH_S = 5.0  # how often, while no message comes, the worker process looks whether its parent is still there


class _Arenas(dict):
    """The parent's arenas, opened at first sight, by name; the parent is told, and removes the name (``_Segment``)."""

    def __init__(self, answers: _Answers) -> None:
        super().__init__()
        self.answers = answers

    def __missing__(self, name: str) -> _Arena:
        arena = self[name] = _Arena(name=name)
        self.answers.put(_Opened(name))
        return arena


def _serve(conn: Any, progress: str) -> None:
    """Run until the parent says stop, or goes away; an error that ends it is sent to the parent first.

    Ctrl-C in a terminal interrupts the whole process group: the parent hears it, and this process, which the parent
    stops or leaves, ignores it (no second traceback).
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _keep_freed_memory()
    _install()  # a warning an update gives is kept for the parent, as in a worker thread
    server = _ChildServer(conn, _Progress(progress))
    server.answers.put(_Ready())
    try:
        with _Inline():  # the offloaded objects here run their own methods
            server.run()
    except BaseException as error:
        server.answers.put(_Fatal(_error_info(error)))
        server.answers.close(_WATCH_S)
        raise


def _keep_freed_memory() -> None:
    """Allocate and free 30 MiB once, so that freed memory is kept here for the next allocation.

    glibc hands a large block back to the system when it is freed, until a block that large has been freed once
    (then it raises its threshold for it, up to 32 MiB). A Metric's update makes temporaries of a few MiB (a binned
    AUROC of 8,192 predictions: 13 MiB each); handed back and mapped again at every update, they page-fault afresh.
    Called in processes of lightning-store's own (the worker, the self-check's ways): it touches no training process.
    """
    block = torch.empty(30 * 2**20, dtype=torch.uint8)
    del block


class _ChildServer:
    """What the worker process does: take the parent's messages in order, run them, and answer (``answers.py``)."""

    def __init__(self, conn: Any, progress: _Progress) -> None:
        self.conn = conn
        self.progress = progress  # how many updates this process has run, for the parent to read
        self.updates_run = 0
        self.objects: dict[int, Module] = {}
        self.defaults: dict[int, _Held] = {}  # each object's defaults, as sent: the parent sends them as references
        self.broken: dict[int, tuple] = {}  # an object that could not be made here: the error, for each update
        self.failed: set[int] = set()  # an object whose update failed: its next updates are not run, until resumed
        self.state: Any = None  # the caller's torch state of the last update
        # a caller's state this thread is in (nothing to apply for it), while nothing else ran
        self.in_force: Any = None
        # the generators' states after the last row of updates, while nothing else ran: the next row's before it
        self.generators: _HostStates | None = None
        self.answers = _Answers(conn)
        self.arenas = _Arenas(self.answers)
        self.readable = _Readable(conn)
        self.ran: list[tuple] = []  # the `_Done`s not sent yet, in order
        self.answer_every = 1  # how many updates run before an answer unasked (`queue._answered_run`)

    def run(self) -> None:
        parent = os.getppid()
        while True:
            try:
                while not self.readable(_WATCH_S):
                    if os.getppid() != parent:  # the parent is gone (its end of the pipe may live in a fork of it)
                        return
                message = _read(self.conn.recv())
            except (EOFError, OSError):
                return
            if type(message) is not _Updates:  # what another message runs may draw: read afresh at the next update
                self.generators = None
            match message:
                case _Updates(updates, run):
                    self.answer_every = run
                    self._run_updates(updates)
                case _Call(object_id, path, method, args):
                    self._call(object_id, path, method, args)
                case _Replace(object_id, payload):
                    self._replace(object_id, payload)
                case _Pull(object_id):
                    self._pull(object_id)
                case _Drop(object_id):
                    self.objects.pop(object_id, None)
                    self.defaults.pop(object_id, None)
                case _Forget(name):
                    arena = self.arenas.pop(name, None)
                    if arena is not None:
                        arena.close(unlink=False)
                case _Resume(object_id):
                    self.failed.discard(object_id)
                case _Filters(filters):
                    warnings.resetwarnings()  # as a change of the parent's: a warning shown once is shown again
                    warnings.filters[:] = filters  # type: ignore[index]
                case _Ask():
                    self._answer()
                case _Stop():
                    self._answer()
                    self.answers.close(1)
                    return
                case _:
                    raise ValueError(f"not a message for lightning-store's offload worker process: {message!r}")

    def _replace(self, object_id: int, payload: bytes) -> None:
        self.failed.discard(object_id)
        self.broken.pop(object_id, None)
        held = self.defaults.pop(object_id, {})
        try:
            self.objects[object_id] = _pickling.loads(payload, functools.partial(_made_from, held))
        except BaseException as error:  # its class cannot be imported here, say: the parent is told, once
            self.objects.pop(object_id, None)
            self.broken[object_id] = _error_info(error)
            self._put(_Broken(object_id, self.broken[object_id]))
            return
        for module in self.objects[object_id].modules():  # the plain Metrics: this process runs them as they are
            module.__class__ = type(module).__dict__.get("_base_class", type(module))
            if "update" in vars(module):
                vars(module)["update"] = _queued_update(vars(module)["update"])
        self.defaults[object_id] = _held(self.objects[object_id])

    def _run_updates(self, updates: list[tuple]) -> None:
        """Run a message's updates in order, as rows: the updates of one object that follow one another.

        A row ends where an answer is due (``answer_every`` updates since the last), which says what it ran.
        """
        start = 0
        while start < len(updates):
            room = max(1, self.answer_every - len(self.ran))
            end = start + 1
            while end < len(updates) and end - start < room and updates[end][0] == updates[start][0]:
                end += 1
            self._run_row(updates[start:end])
            start = end

    def _run_row(self, row: list[tuple]) -> None:
        """Run ``row``, updates of one object, in order; then say what ran, and whether the row drew.

        The generators are compared around the row, not each update: where cheap updates ran back to back, the
        checks took 7 to 10 µs of each, a third of a ``MeanMetric``'s own time. A draw is then found in the row,
        and said of the updates it ran (``_Done.drawn_since``). Nothing else draws in this process.
        """
        object_id = row[0][0]
        # this thread's caller's state and the generators' are known from the last update, if nothing else ran
        before, settled = self.generators, self.generators is not None
        done: list[list[Any]] = []
        first, last, failed = None, None, False
        for _, number, path, inputs, state in row:
            if state is not None:  # else the same as the last update's
                self.state = state
            kept: list[tuple] = []
            update_s = 0.0
            discarded, error = self._passed_over(object_id)
            if not discarded and error is None:
                if before is None:
                    before = _host_states(torch_too=True)
                target = self.objects[object_id].get_submodule(path) if path else self.objects[object_id]
                in_force = settled and self.state is self.in_force
                error, kept, update_s = _run_update(target, inputs, self.state, self.arenas, in_force)
                if not in_force:  # this thread in the caller's state: the next update's, often
                    self.in_force = self.state if self.state.in_force(default_dtype=True) else None
                first = number if first is None else first
                last, settled = len(done), error is None
                if error is not None:
                    failed = True
                    self.failed.add(object_id)
            done.append([object_id, number, error, kept, [], discarded, True, update_s, None])
            self.updates_run += 1
            self.progress.write(self.updates_run)
        if last is not None:  # an update ran
            after = _host_states(torch_too=True)
            drawn = _drawn(before, after)  # type: ignore[arg-type]
            if drawn:
                self.failed.add(object_id)
                done[last][4] = drawn
                done[last][8] = first if first != done[last][1] else None
            self.generators = after if not failed and not drawn else None
        self.ran.extend(map(tuple, done))
        said = any(error is not None or kept or drawn for _, _, error, kept, drawn, *_ in done)  # said at once
        if said or len(self.ran) >= self.answer_every:
            self._answer()

    def _call(self, object_id: int, path: str | None, method: str, args: tuple) -> None:
        """Run ``method`` of the object (its ``reset``, say), unless it could not be made here or failed."""
        kept: list[tuple] = []
        discarded, error = self._passed_over(object_id)
        if not discarded and error is None:
            target = self.objects[object_id].get_submodule(path) if path else self.objects[object_id]
            with _KeptWarnings() as caught:
                try:
                    getattr(target, method)(*args)
                except BaseException as exception:  # `SystemExit` and pytest's `Failed` too: sent, and this goes on
                    error = _error_info(exception)
            kept = _kept(caught)
            if error is not None:
                self.failed.add(object_id)
        self.ran.append((object_id, None, error, kept, [], discarded, False, 0.0, None))
        if error is not None or kept or len(self.ran) >= self.answer_every:
            self._answer()

    def _passed_over(self, object_id: int) -> tuple[bool, tuple | None]:
        """Whether the object's updates and calls are not run here, and the error to send if it was never sent.

        An object that could not be made here (the parent was told) or whose update failed is passed over; one never
        sent here is said, not dropped in silence, and passed over from then on.
        """
        if object_id in self.failed or object_id in self.broken:
            return True, None
        if object_id in self.objects:
            return False, None
        self.failed.add(object_id)
        return False, _error_info(
            RuntimeError("the worker process holds no copy of the Metric (a lightning-store bug)")
        )

    def _answer(self) -> None:
        """Send what ran since the last answer."""
        if self.ran:
            self.answers.put(_Ran(self.ran))
            self.ran = []

    def _put(self, message: Any) -> None:
        """Send ``message`` after what ran before it."""
        self._answer()
        self.answers.put(message)

    def _pull(self, object_id: int) -> None:
        obj = self.objects.get(object_id)
        if obj is None:
            self._put(_States(object_id, None, self.broken.get(object_id)))
            return
        # with the defaults an update changed here, if one did: the parent's are then these, and sent as bytes
        changed = _changed_defaults(obj, self.defaults.get(object_id, {}))
        values = [
            {name: _pickling.stacked(value) for name, value in {**_data_of(module), **more}.items()}
            for module, more in zip(obj.modules(), changed, strict=True)
        ]
        try:
            self._put(_States(object_id, _pickling.dumps(values), None))
        except BaseException as error:  # an attribute an update set that cannot be pickled, or no memory for it
            where = "" if isinstance(error, MemoryError) else _unpicklable(obj, values)
            self._put(_States(object_id, None, _error_info(error, where)))


def _run_update(
    target: Module, inputs: Any, state: Any, arenas: _Arenas, in_force: bool
) -> tuple[tuple | None, list, float]:
    """Run ``target.update`` on the inputs, in the caller's ``state``: what it raised, the warnings it gave.

    And the seconds the update took: the work moved off the caller's step. ``in_force``: this thread is in the
    caller's ``state`` already (the last update's, which found nothing to apply), which is not applied again.
    """
    error, update_s = None, 0.0
    with _KeptWarnings() as caught:
        try:
            if isinstance(inputs, list):  # an update's whole CPU tensors (`inputs._Whole`)
                args, kwargs = _read_whole(inputs, arenas.__getitem__)
            else:  # pickled at its call
                inputs = pickle.loads(inputs) if isinstance(inputs, bytes) else inputs
                args, kwargs = _read_inputs(inputs, arenas.__getitem__)
            with _NOTHING_TO_APPLY if in_force else state.applied(default_dtype=True):
                started = time.perf_counter()
                try:
                    cast(Any, target).update(*args, **kwargs)
                finally:
                    update_s = time.perf_counter() - started
        except BaseException as exception:  # `SystemExit` and pytest's `Failed` too: sent, and this process goes on
            error = _error_info(exception)
    return error, _kept(caught), update_s


def _kept(caught: list[warnings.WarningMessage]) -> list[tuple]:
    return [(w.category, _picklable(w.message), w.filename, w.lineno) for w in caught[:_KEPT_WARNINGS]]


def _data_of(module: Module) -> dict[str, Any]:
    """What an update may have changed in ``module``: every attribute but the Module's own and its methods."""
    return {k: v for k, v in vars(module).items() if k not in _MODULE_OWN and not callable(v)}


def _error_info(error: BaseException, where: str = "") -> tuple:
    """What the parent needs to raise ``error`` again: the exception pickled, its class name, text and traceback.

    An exception whose constructor takes other arguments pickles, and does not unpickle: it is sent as its class,
    ``args`` and attributes, which the parent makes again with its type. ``where`` says more (an attribute's name).
    """
    try:
        pickled: bytes | None = pickle.dumps(error)
        pickle.loads(pickled)  # type: ignore[arg-type]
    except Exception:
        try:
            pickled = pickle.dumps(_pickling._ExceptionParts(error))
        except Exception:
            pickled = None
    trace = "".join(traceback.format_exception(type(error), error, error.__traceback__))
    return pickled, type(error).__qualname__, str(error), trace, where


def _unpicklable(obj: Module, values: list[dict[str, Any]]) -> str:
    """The attributes of ``obj``'s Modules that do not pickle, by name (``cache (Lock)``), or ``""``."""
    names = [name for name, _ in obj.named_modules()]
    found = [
        f"{f'{path}.' if path else ''}{key} ({type(value).__name__})"
        for path, data in zip(names, values, strict=True)
        for key, value in data.items()
        if not _pickling.pickles(value)
    ]
    return ", ".join(found)


def _picklable(message: Any) -> Any:
    return message if _pickling.pickles(message) else str(message)
