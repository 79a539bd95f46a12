"""Where a benchmark's table goes: stdout, and a markdown file under ``docs/`` headed by when, where and how it ran.

The performance pages of the docs include these files, so that every number there comes from a run.

    from _tables import publish
    publish("cpu_log_overhead", lines, notes)  # prints the table, writes docs/performance/results/cpu_log_overhead.md
"""

import argparse
import contextlib
import datetime
import os
import platform
import sys
from collections.abc import Sequence
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent.parent / "docs" / "performance" / "results"
_DISTRIBUTIONS = ("torch", "pytorch-lightning", "torchmetrics", "lightning-store")


def add_docs_option(parser: argparse.ArgumentParser) -> None:
    """``--no-docs``: print the table only, leaving the docs' file as it is."""
    parser.add_argument("--no-docs", action="store_true", help=f"print only; do not write the table under {RESULTS}")


def publish(
    name: str, lines: Sequence[str], notes: Sequence[str] = (), *, goals: Sequence[str] = (), write: bool = True
) -> Path | None:
    """Print ``lines`` (a markdown table, with any line above it) and ``notes``; write them to ``RESULTS/name.md``.

    Args:
        name: the file's name, without ``.md``.
        lines: what the benchmark measured, in markdown.
        notes: lines printed and written under it, as a list (what else it measured, say).
        goals: the project's goals and whether this run met them (CONTRIBUTING.md): printed, not written, since
            the docs tell a user what a run measured, not how the project judges it.
        write: whether to write the file (``False`` for a check of the script itself).

    Returns:
        The file written, or ``None``.
    """
    body = "\n".join(lines)
    if notes:
        body += "\n\n" + "\n".join(f"- {note}" for note in notes)
    print(body, flush=True)
    if goals:
        print("\ngoals (printed only):\n" + "\n".join(f"- {goal}" for goal in goals), flush=True)
    if not write:
        return None
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.md"
    path.write_text(f"{header()}\n\n{body}\n")
    print(f"\nwritten to {path}")
    return path


def header() -> str:
    """The date, the machine, the versions and the command, as a markdown list."""
    return "\n".join(
        [
            f"- date: {datetime.date.today().isoformat()}",
            f"- machine: {machine()}",
            f"- versions: {versions()}",
            f"- command: `{command()}`",
        ]
    )


def machine() -> str:
    """The CPU's model and how many CPUs this process may use; the GPU, if CUDA is available."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    text = f"{_cpu_model()}, {cpus} CPUs, {platform.system()} {platform.machine()}"
    if torch.cuda.is_available():
        text += f"; {torch.cuda.get_device_name()} (CUDA {torch.version.cuda})"
    return text


def versions() -> str:
    found = [f"Python {platform.python_version()}"]
    for distribution in _DISTRIBUTIONS:
        try:
            found.append(f"{distribution} {version(distribution)}")
        except PackageNotFoundError:
            continue
    return ", ".join(found)


def command() -> str:
    """The command line, as run from the repository's root."""
    script = Path(sys.argv[0]).resolve()
    with contextlib.suppress(ValueError):  # a script outside the repository is named as it was run
        script = script.relative_to(RESULTS.parents[2])
    return " ".join(["python", str(script), *sys.argv[1:]])


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"
