"""``python -m lightning_store``: parse the command line, run the checks, print them, write ``--json``."""

import argparse
import json
import os
import sys
import tempfile
import textwrap
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TextIO

from lightning_store._selfcheck import _checks
from lightning_store._selfcheck._core import Context, run_check
from lightning_store._selfcheck._env import best_accelerator, environment
from lightning_store._selfcheck._fits import own_defaults
from lightning_store._selfcheck._render import check_line, environment_block, exit_code, json_document, summary_line

_DESCRIPTION = """\
Check, on this machine, that lightning-store's store_on_cpu holds: short real Trainer fits on the best device
found (CUDA, else MPS, else CPU; --device picks one) log the same values plainly and with store_on_cpu=True, and
each check prints PASS, FAIL or SKIP (with its reason); the step-time ratio is measured, not checked. Metrics
given to store_states_on_cpu and offload_to_cpu are checked against the plain ones too. The fits ignore
PL_TRAINER_* defaults (the report lists them). Nothing is downloaded or left behind."""
_EPILOG = """\
exit status:
    0  every check that ran passed
    1  a check failed
    2  a usage error, or --json could not be written
  130  interrupted (Ctrl-C)"""


class _HelpFormatter(argparse.HelpFormatter):
    """Wraps the prose of the description and the epilog to the terminal's width, never inside a word.

    An indented line (a row of the exit-status table) is kept as it is.
    """

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        lines: list[str] = []
        prose: list[str] = []  # the lines of the paragraph read so far
        for line in [*text.splitlines(), ""]:  # the blank line at the end ends the last paragraph
            if line.strip() and not line[0].isspace():
                prose.append(line)
                continue
            if prose:
                words = " ".join(" ".join(prose).split())
                wrap = textwrap.TextWrapper(width, indent, indent, break_long_words=False, break_on_hyphens=False)
                lines += wrap.wrap(words)
                prose = []
            lines.append(indent + line if line.strip() else "")
        return "\n".join(lines[:-1])


def main(argv: Sequence[str] | None = None) -> int:
    """Run the self-check; return the exit status (0: every check that ran passed, 1: one failed, 2: usage).

    Ctrl-C ends it with one line and 130, once every process it started has ended.

    The user's ``PL_TRAINER_*`` defaults are set aside during the fits (the environment block lists them as ignored):
    each check runs the fits it describes.

    Args:
        argv: the command-line arguments (``sys.argv[1:]`` when ``None``).
    """
    parser = _parser()
    args = parser.parse_args(argv)
    accelerator = best_accelerator() if args.device == "auto" else args.device
    if args.device != "auto" and args.device != "cpu" and best_accelerator() != args.device:
        parser.error(f"--device {args.device}: no such device is available here")
    started = time.perf_counter()
    out: TextIO | None = None if args.json == "-" else sys.stdout  # JSON on stdout: nothing else there
    env = {**environment(), "fits run on": accelerator}
    _print(out, f"lightning-store self-check\n\n{environment_block(env)}\n")
    results = []
    try:
        with tempfile.TemporaryDirectory(prefix="lightning-store-selfcheck-") as root, own_defaults():
            context = Context(accelerator, Path(root))
            for check in list(_checks.CHECKS):
                results.append(run_check(check, context))
                _print(out, check_line(results[-1]))
    except KeyboardInterrupt:  # the processes the checks start never get it; they end with the checks, or at exit
        print(f"{parser.prog}: interrupted", file=sys.stderr)
        return 130
    seconds = time.perf_counter() - started
    wall = seconds_since_start()
    _print(out, f"\n{summary_line(results, seconds, wall)}")
    if args.json is not None:
        text = json.dumps(json_document(env, accelerator, results, seconds, wall), indent=2)
        if args.json == "-":
            print(text, flush=True)
        else:
            try:
                Path(args.json).write_text(text + "\n")
            except OSError as err:  # checked before the checks ran, but the disk may have changed since
                print(f"{parser.prog}: error: --json {args.json}: cannot write it: {err.strerror}", file=sys.stderr)
                return 2
    return exit_code(results)


def seconds_since_start() -> float | None:
    """Wall time since this process started (imports included), from ``/proc``; ``None`` where there is none."""
    try:
        with open("/proc/self/stat") as stat, open("/proc/uptime") as uptime:
            fields = stat.read().rpartition(")")[2].split()  # the command name, in parentheses, may hold spaces
            started = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22, starttime: clock ticks after boot
            now = float(uptime.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return now - started if now >= started else None


def _json_path(value: str) -> str:
    """``--json``'s argument, refused before any check runs if the report could not be written there."""
    if value == "-":
        return value
    path = Path(value)
    parent = path.parent
    problem = ""
    if path.is_dir():
        problem = "is a directory; give a file name, such as " + str(path / "selfcheck.json")
    elif not parent.exists():
        problem = f"its directory {parent} does not exist; create it first"
    elif not parent.is_dir():
        problem = f"{parent} is not a directory"
    elif path.exists() and not os.access(path, os.W_OK):
        problem = "the file exists and is not writable"
    elif not path.exists() and not os.access(parent, os.W_OK | os.X_OK):
        problem = f"its directory {parent} is not writable"
    if problem:
        raise argparse.ArgumentTypeError(f"cannot write the report to {value}: {problem}")
    return value


def _print(out: TextIO | None, text: str) -> None:
    if out is not None:
        print(text, file=out, flush=True)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m lightning_store",
        description=_DESCRIPTION,
        epilog=_EPILOG,
        formatter_class=_HelpFormatter,
    )
    parser.add_argument(
        "--json",
        metavar="PATH",
        type=_json_path,
        help="also write the results as JSON to PATH; '-' writes them to stdout instead of the text report",
    )
    parser.add_argument(
        "--device",
        choices=("auto", "cuda", "mps", "cpu"),
        default="auto",
        help="where the fits run (default: auto, the best device found)",
    )
    return parser
