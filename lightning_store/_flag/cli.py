"""Where ``LightningCLI`` took ``trainer.move_metrics_to_cpu`` from: an argument, a config file's line, or code."""

import re
import sys
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

_KEY = re.compile(r"^\s*move_metrics_to_cpu\s*:")
_ARGUMENT = "--trainer.move_metrics_to_cpu"


@dataclass(frozen=True)
class _Source:
    """What set the flag, in words, and the file and line a warning about it points at."""

    what: str
    filename: str
    lineno: int


def _cli_source() -> _Source | None:
    """Where the ``LightningCLI`` that is building a Trainer now took the flag from; ``None`` if none is.

    The last of: a ``--trainer.move_metrics_to_cpu`` argument (reported at the ``LightningCLI(...)`` line), a config
    file that sets ``move_metrics_to_cpu`` (reported at that line of the file), else the ``LightningCLI(...)`` line
    itself (``trainer_defaults``, a dict of arguments).
    """
    frame = _cli_frame()
    if frame is None:
        return None
    cli = frame.f_locals["self"]
    caller = frame
    while caller.f_back is not None and caller.f_locals.get("self") is cli:  # a subclass's `__init__` too
        caller = caller.f_back
    filename, lineno = caller.f_code.co_filename, caller.f_lineno
    args = frame.f_locals.get("args")
    argument = _argument(sys.argv[1:] if args is None else args)
    if argument is not None:
        return _Source(f"the argument `{argument}`", filename, lineno)
    for path in reversed(_config_files(cli)):
        line = _line_of_key(path)
        if line is not None:
            return _Source(f"`trainer.move_metrics_to_cpu` in {path}", str(path), line)
    return _Source("`trainer.move_metrics_to_cpu` given to `LightningCLI`", filename, lineno)


def _cli_frame() -> FrameType | None:
    """The frame of ``LightningCLI.__init__`` (either namespace) that is running now, if any."""
    classes = tuple(
        module.LightningCLI
        for name in ("pytorch_lightning.cli", "lightning.pytorch.cli")
        if (module := sys.modules.get(name)) is not None
    )
    frame = sys._getframe(1) if classes else None
    while frame is not None:
        if frame.f_code.co_name == "__init__" and isinstance(frame.f_locals.get("self"), classes):
            return frame
        frame = frame.f_back
    return None


def _argument(args: Any) -> str | None:
    """The last ``--trainer.move_metrics_to_cpu`` argument in ``args``, with its value, as the user typed it."""
    if not isinstance(args, list | tuple):  # a dict or a Namespace: given in code
        return None
    args = [str(arg) for arg in args]
    for index in range(len(args) - 1, -1, -1):
        arg = args[index]
        if arg.startswith(f"{_ARGUMENT}="):
            return arg
        if arg == _ARGUMENT:
            return f"{arg} {args[index + 1]}" if index + 1 < len(args) else arg
    return None


def _config_files(cli: Any) -> list[Path]:
    """The config files ``cli`` read, in the order read (``--config``, then ``--trainer FILE``)."""
    config = getattr(cli, "config", None)
    if config is None:
        return []
    subcommand = config.get("subcommand")
    if subcommand:
        config = config.get(subcommand)
    found = [*(config.get("config") or []), config.get("trainer.__path__")]
    return [Path(getattr(path, "absolute", path)) for path in found if path is not None]


def _line_of_key(path: Path) -> int | None:
    """The line (from 1) of the last ``move_metrics_to_cpu:`` key in a YAML file; ``None`` if none or unreadable."""
    try:
        lines = path.read_text().splitlines()
    except (OSError, UnicodeDecodeError):
        return None
    found = [number for number, line in enumerate(lines, start=1) if _KEY.match(line)]
    return found[-1] if found else None
