"""``python -m lightning_store``: parse the command line, run the checks, print them, write ``--json``."""

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TextIO

from . import _checks
from ._core import Context, run_check
from ._env import best_accelerator, environment
from ._render import check_line, environment_block, exit_code, json_document, summary_line

_DESCRIPTION = """\
Check, on this machine, that lightning-store's store_on_cpu holds: short real Trainer fits on the best device
found (CUDA, else MPS, else CPU) log the same values plainly and with store_on_cpu=True, and each check prints
PASS, FAIL or SKIP (with its reason); the step-time ratio is a figure. Nothing is downloaded or left behind."""
_EPILOG = "exit status: 0 when every check that ran passed, 1 when one failed, 2 for a usage error."


def main(argv: Sequence[str] | None = None) -> int:
    """Run the self-check; return the exit status (0: every check that ran passed, 1: one failed).

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
    with tempfile.TemporaryDirectory(prefix="lightning-store-selfcheck-") as root:
        context = Context(accelerator, Path(root))
        for check in list(_checks.CHECKS):
            results.append(run_check(check, context))
            _print(out, check_line(results[-1]))
    seconds = time.perf_counter() - started
    _print(out, f"\n{summary_line(results, seconds)}")
    if args.json is not None:
        text = json.dumps(json_document(env, accelerator, results, seconds), indent=2)
        if args.json == "-":
            print(text, flush=True)
        else:
            Path(args.json).write_text(text + "\n")
    return exit_code(results)


def _print(out: TextIO | None, text: str) -> None:
    if out is not None:
        print(text, file=out, flush=True)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m lightning_store",
        description=_DESCRIPTION,
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--json",
        metavar="PATH",
        help="also write the results as JSON to PATH; '-' writes them to stdout instead of the text report",
    )
    parser.add_argument(
        "--device",
        choices=("auto", "cuda", "mps", "cpu"),
        default="auto",
        help="where the fits run (default: auto, the best device found)",
    )
    return parser
