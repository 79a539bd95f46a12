"""One way of running check 10's step (no Metric, inline, or offloaded to a worker) in a process of its own.

Side by side in one process, the step without the Metric ran slower after the inline Metric's updates and beside a
worker thread (its median 1.78 to 1.98 ms in three runs, against 1.73 to 1.77 ms in a process of its own), and
every ratio against it read low. Each way runs in a fresh process, started as DataLoader workers are (``spawn``),
and answers the parent's requests in turn, so that the rounds stay paired.
"""

import contextlib
import multiprocessing
import signal
from collections.abc import Callable
from typing import Any

import torch

from lightning_store.metrics._offload.process.parent import _ctrl_c_blocked

_ANSWER_S = 300.0  # the longest a way's process may take to answer: a request takes a second or two
_END_S = 30.0  # the longest it may take to end once told (its worker process ends with it)


class Way:
    """The process of one way: ``serve(way, threads, conn)`` runs there, and answers each request sent to it.

    Args:
        way: ``"none"``, ``"inline"``, ``"thread"`` or ``"process"``.
        serve: a module-level function (``spawn`` imports it there), given ``way``, this process's number of torch
            threads and the connection; it returns once it receives ``None``, after sending its last answer.
    """

    def __init__(self, way: str, serve: Callable[[str, int, Any], None]) -> None:
        self.way = way
        self.conn, theirs = multiprocessing.Pipe()
        context = multiprocessing.get_context("spawn")  # a fresh process, not a fork of this one
        self.process = context.Process(target=_run, args=(serve, way, torch.get_num_threads(), theirs))
        with _ctrl_c_blocked():  # never interrupted, not even while it imports torch
            self.process.start()  # not a daemon: the way's own worker process is a child of it
        theirs.close()
        self.closed = False

    def __enter__(self) -> "Way":
        return self

    def ask(self, request: Any) -> Any:
        """Send ``request``; its answer, or the error raised there."""
        self.conn.send(request)
        return self._answer(request)

    def close(self) -> Any:
        """Tell the process to end: its last answer (the warnings it gave, say), or the error raised there."""
        self.closed = True
        return self.ask(None)

    def _answer(self, request: Any) -> Any:
        if not self.conn.poll(_ANSWER_S):
            raise TimeoutError(
                f"the process of the way {self.way!r} gave no answer to {request!r} in {_ANSWER_S:.0f} s"
            )
        answer = self.conn.recv()
        if isinstance(answer, BaseException):
            raise RuntimeError(f"the process of the way {self.way!r} failed on {request!r}: {answer}") from answer
        return answer

    def __exit__(self, *exc: object) -> None:
        if not self.closed:  # an error in the parent: the process is told to end, and not waited for long
            with contextlib.suppress(OSError):
                self.conn.send(None)
        self.process.join(_END_S)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        with contextlib.suppress(OSError):
            self.conn.close()


def _run(serve: Callable[[str, int, Any], None], way: str, threads: int, conn: Any) -> None:
    """``serve`` in the way's process, Ctrl-C ignored (it started with it blocked).

    Ctrl-C in a terminal interrupts the whole process group: the parent hears it, and tells this process to end
    (no second traceback).
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    serve(way, threads, conn)
