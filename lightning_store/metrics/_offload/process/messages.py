"""The messages between this process and its worker process: one small class each, sent as a tuple of plain values.

To the worker process, in the order sent through the pipe:

- ``_Replace``: a copy of an offloaded object (pickled), which it takes in place of the one it holds;
- ``_Updates``: updates of its Modules, in order, each an ``_Update``: its inputs pickled at the call (their
  tensors in a shared arena). One message for several updates while it has updates to run: each message costs both
  processes a pipe's write or read, and the worker process would only queue them;
- ``_Call``: a call of a Module's own method after the updates sent before (a collection's copy of its states);
- ``_Pull``: a read: send the object's states back;
- ``_Drop``: the object is gone here: free its copy;
- ``_Forget``: an arena is closed here: close it there too;
- ``_Resume``: the error of an update was raised here: run the object's updates again;
- ``_Filters``: the warnings filters of this process, for the updates to warn as they would here;
- ``_Ask``: this process waits for an answer: send what ran now;
- ``_Stop``: end (at exit, or once no offloaded object is left).

From the worker process, in the order it made them:

- ``_Ready``: it started (and opened the parent's counter of its progress);
- ``_Opened``: it opened an arena (``arena._Segment``: the parent then removes its name);
- ``_Fatal``: the error that ends it;
- ``_States``: a read's answer, the states or the error that kept them from being sent;
- ``_Broken``: the copy of an object could not be made there (its class cannot be imported, say);
- ``_Ran``: the updates and calls run since the last one, in order, each a ``_Done``: what it raised, warned and
  drew, or that it was not run after a failed one. One answer for a run of updates: at once after a row of an
  object's updates (``child._ChildServer._run_row``) in which one failed, drew or warned (said at the parent's
  next call, as with a thread), every ``_Updates.run`` updates (half the queue's ``max_pending``: the parent gets
  room before its queue is full, and is woken once for as many updates), and when the parent asks (``_Ask``: it
  waits for one). Not once caught up: a worker process that keeps up with the step would then answer every
  update, and the parent read an answer at every call.

A message goes as its kind's number and its fields (:func:`_wire`, :func:`_read`): a class pickles and unpickles
through Python code, about 3 us each way against under 1 us for a tuple, and an update is sent, and answered, at
every call.
"""

import select
from typing import Any, NamedTuple


class _Replace(NamedTuple):
    object_id: int
    payload: bytes


class _Update(NamedTuple):  # one of `_Updates`'s, sent as its fields
    object_id: int
    number: int
    path: str
    inputs: bytes
    state: Any  # the caller's torch state, or None: the same as the last update's


class _Updates(NamedTuple):
    updates: list[tuple]  # each an `_Update`'s fields
    run: int  # how many updates the worker process runs before it answers unasked (`_answered_run`)


class _Call(NamedTuple):
    object_id: int
    path: str | None
    method: str
    args: tuple


class _Pull(NamedTuple):
    object_id: int


class _Drop(NamedTuple):
    object_id: int


class _Forget(NamedTuple):
    name: str  # the arena's


class _Resume(NamedTuple):
    object_id: int


class _Filters(NamedTuple):
    filters: list


class _Ask(NamedTuple):
    pass


class _Stop(NamedTuple):
    pass


class _Ready(NamedTuple):
    pass


class _Opened(NamedTuple):
    name: str  # the arena's


class _Fatal(NamedTuple):
    error: tuple  # as `child._error_info` makes it


class _States(NamedTuple):
    object_id: int
    payload: bytes | None  # the Modules' data, pickled
    error: tuple | None


class _Broken(NamedTuple):
    object_id: int
    error: tuple


class _Done(NamedTuple):  # one of `_Ran`'s, sent as its fields
    object_id: int
    number: int | None  # the update's, None for a call
    error: tuple | None
    kept: list  # the warnings it gave
    drawn: list[str]  # the global generators it drew from
    discarded: bool  # not run: an update of the object failed before
    spent: bool  # its inputs' arena space may be used again
    update_s: float  # how long its `update` ran (0.0 for a call, or not run)
    drawn_since: int | None  # with `drawn`: the first of the updates in a row with it, checked together (or None)


class _Ran(NamedTuple):
    done: list[tuple]  # each a `_Done`'s fields


_KINDS: tuple[type, ...] = (
    *(_Replace, _Updates, _Call, _Pull, _Drop, _Forget, _Resume, _Filters, _Stop, _Ask),
    *(_Ready, _Fatal, _States, _Broken, _Ran, _Opened),
)
_NUMBER = {kind: number for number, kind in enumerate(_KINDS)}


def _wire(message: Any) -> tuple:
    """What is pickled of ``message``: its kind's number, then its fields."""
    return (_NUMBER[type(message)], *message)


def _read(raw: tuple) -> Any:
    """The message that :func:`_wire` gave ``raw``; a ``ValueError`` if it is none."""
    try:
        kind = _KINDS[raw[0]]
    except (IndexError, KeyError, TypeError):
        raise ValueError(f"not a message of lightning-store's offload worker: {raw!r}") from None
    return kind._make(raw[1:])


class _Readable:
    """Whether a message waits to be read on ``conn``, waiting at most a timeout: one ``select.poll`` kept for it.

    ``Connection.poll`` makes a selector at each call (about 10 µs), and both processes look at every update. A pipe
    whose other end closed reads as ready: the read then raises ``EOFError``.
    """

    __slots__ = ("conn", "poller")

    def __init__(self, conn: Any) -> None:
        self.conn = conn
        self.poller: Any = None
        if hasattr(select, "poll"):  # not on Windows: `Connection.poll` there
            self.poller = select.poll()
            self.poller.register(conn.fileno(), select.POLLIN)

    def __call__(self, timeout_s: float) -> bool:
        if self.poller is None:
            return bool(self.conn.poll(timeout_s))
        return bool(self.poller.poll(timeout_s * 1000))
