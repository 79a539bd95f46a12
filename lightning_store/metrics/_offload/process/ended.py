"""Why the worker process ended, or could not take an object: the real cause, and what to do, in words."""

import ast
import os
import signal
import sys
from types import FrameType, ModuleType
from typing import Any

from lightning_store.metrics._offload.workers import _cannot_start, _short_of

_RESET = "`reset()` the Metric to go on from an empty state."
_GUARD = (
    "a script that offloads a Metric guards its code with `if __name__ == '__main__':`, and defines the Metric's"
    " class (and what its attributes hold) in a module or in that script"
)


def _why_ended(code: int | None, ready: bool, fatal: tuple | None) -> tuple[str, str]:
    """What to say of a worker process that ended with exit ``code``, after it started (``ready``) or not.

    ``fatal`` is the error that ended it, as it sent it (see ``child._error_info``). Returns the reason and the hint.
    """
    if code is None:
        how = "it could not be reached"
    elif code < 0:
        how = f"killed by signal {_signal_name(-code)}"
        if -code == signal.SIGKILL:
            how += ", which the system's out-of-memory killer sends, as does `kill -9`"
    else:
        how = f"exit code {code}"
    last = f" Its last exception: {fatal[1]}: {fatal[2]}" if fatal is not None else ""
    if not ready:
        reason = (
            f"lightning-store's offload worker process ended before it started ({how}).{_stop(last)} It starts as"
            " DataLoader workers do with the `spawn` method, importing this program's `__main__` module again."
        )
        return reason, f"{_GUARD}; or pass worker='thread' to offload_to_cpu. Then {_RESET}"
    reason = f"lightning-store's offload worker process ended ({how}).{_stop(last)}"
    if code is not None and -code == signal.SIGKILL:
        return reason, f"give the job more memory, or offload fewer or smaller Metrics; then {_RESET}"
    return reason, _RESET


def _process_cannot_start(error: OSError) -> RuntimeError:
    """The error of a worker process that could not start (``error``: why), raised at the call that started it."""
    return _cannot_start(
        "process",
        f"{type(error).__name__}: {error}",
        f"{_short_of(error)}; or pass worker='thread' to offload_to_cpu, which starts no process",
    )


def _why_not_made(error: tuple) -> tuple[str, str]:
    """What to say of an object the worker process could not make from its copy (``error``: as it sent it)."""
    reason = f"the worker process could not make its copy of it ({error[1]}: {error[2]})."
    if _main_is_not_a_file() and ("__main__" in error[2] or "__mp_main__" in error[2]):
        return reason + _FROM_NO_FILE, "define the class in a module the worker process can import, or pass" + (
            " worker='thread' to offload_to_cpu, which works there."
        )
    return reason, f"{_GUARD}; or pass worker='thread' to offload_to_cpu."


_FROM_NO_FILE = (
    " Its class, or what an attribute holds, is defined in `__main__` of a program run with `python -c`, from"
    " stdin or in a notebook, which a process of its own cannot import."
)


def _main_defines(obj: Any) -> str | None:
    """The name of a class of ``obj``'s Modules that ``__main__`` defines and a worker process cannot import."""
    if not _main_is_not_a_file():
        return None
    for module in obj.modules():
        if type(module).__module__ == "__main__":
            return type(module).__qualname__
    return None


def _check_main_runs_again() -> None:
    """Raise unless a process spawned now can run this program's ``__main__`` again, as it is running now.

    It cannot from stdin. It must not run again the statement of ``__main__`` running now, outside
    ``if __name__ == "__main__":``: a process spawned now runs the module's top-level code again, and the statement
    that led here (a ``trainer.fit``, say) would run again there, before the worker process could start.
    """
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if main is None or path is None:  # `python -c`, a notebook: a class it defines is refused (`_main_defines`)
        return
    if _main_is_not_a_file():  # a file named, which does not exist: stdin
        raise RuntimeError(
            f"lightning-store's offload worker process cannot start: it starts as DataLoader workers do with the"
            f" `spawn` method, which runs this program's `__main__` again, and this one was read from {path}, which"
            " another process cannot read. HINT: pass worker='thread' to offload_to_cpu, or run the program from a"
            " file."
        )
    line = _unguarded_statement(main, path)
    if line is not None:
        raise RuntimeError(
            "lightning-store's offload worker process cannot start: it starts as DataLoader workers do with the"
            " `spawn` method, which runs this program's `__main__` module again, and the statement at line"
            f" {line} of {path}, which led to this update, is not under `if __name__ == '__main__':`: the worker"
            " process would run it again. HINT: put the script's code under `if __name__ == '__main__':`, or pass"
            " worker='thread' to offload_to_cpu."
        )


def _unguarded_statement(main: ModuleType, path: str) -> int | None:
    """The first line of the top-level statement of ``main`` running now, unless ``__name__`` guards it.

    Judged on the file as it is now, only if it compiles to the code running: a script edited since it started
    (its lines moved) is not judged. A process spawned then runs the new one, and one that runs its statement
    again ends before it starts, which the worker's error says, with the guard in its HINT.
    """
    frame: FrameType | None = sys._getframe(1)
    running = None
    while frame is not None:  # the outermost frame of the module's own code
        if frame.f_code.co_name == "<module>" and frame.f_globals is vars(main):
            running = frame
        frame = frame.f_back
    if running is None:
        return None
    try:
        with open(path, "rb") as file:
            tree = ast.parse(file.read())
        now = compile(tree, path, "exec", dont_inherit=True)
    except (OSError, SyntaxError, ValueError):  # not Python source that can be read: not judged
        return None
    if now.co_code != running.f_code.co_code or list(now.co_lines()) != list(running.f_code.co_lines()):
        return None  # edited since it started: its lines are not those running
    line = running.f_lineno
    for statement in tree.body:
        if statement.lineno <= line <= (statement.end_lineno or statement.lineno):
            guarded = isinstance(statement, ast.If) and any(
                isinstance(node, ast.Name) and node.id == "__name__" for node in ast.walk(statement.test)
            )
            return None if guarded else statement.lineno
    return None


def _main_is_not_a_file() -> bool:
    """Whether ``__main__`` is no file a spawned process imports: ``python -c``, stdin, a notebook."""
    main = sys.modules.get("__main__")
    if getattr(main, "__spec__", None) is not None:  # `python -m`: imported by name
        return False
    path = getattr(main, "__file__", None)
    return path is None or not os.path.exists(path)


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return str(number)


def _stop(text: str) -> str:
    return text if not text or text.endswith((".", "!", "?")) else f"{text}."
