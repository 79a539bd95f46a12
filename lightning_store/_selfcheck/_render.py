"""How the self-check reads: an environment block, one line per check, a summary; or the same as JSON."""

import math
import shutil
import textwrap
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import asdict
from typing import Any

from lightning_store._selfcheck._core import CheckResult

SCHEMA = 1  # of the JSON document; raised when a field changes meaning or goes away
INDENT = " " * 6  # under a check's status: its detail and its table


def terminal_width() -> int:
    """The terminal's width (``COLUMNS`` if set); 80 where there is no terminal, 40 at the least."""
    return max(shutil.get_terminal_size().columns, 40)


def wrap(text: str, width: int, indent: str = "", first: str | None = None) -> str:
    """``text`` in lines of at most ``width`` characters, each after ``indent`` (the first after ``first``)."""
    wrapper = textwrap.TextWrapper(
        width, initial_indent=indent if first is None else first, subsequent_indent=indent, break_on_hyphens=False
    )
    return "\n".join(wrapper.wrap(text)) or (first or indent).rstrip()


def environment_block(env: Mapping[str, str], width: int | None = None) -> str:
    """``label  value`` lines, aligned; a value too long for ``width`` goes on under its start."""
    width = width or terminal_width()
    label_width = max(map(len, env)) + 2
    indent = " " * label_width
    return "\n".join(wrap(value, width, indent, first=label.ljust(label_width)) for label, value in env.items())


def check_line(result: CheckResult, width: int | None = None) -> str:
    """``PASS  title``, then the detail (a SKIP's reason in parentheses) and its table, if any, indented under it."""
    width = width or terminal_width()
    detail = f"({result.detail})" if result.status == "SKIP" else result.detail
    lines = [f"{result.status}  {result.title}", wrap(detail, width, INDENT)]
    lines += [INDENT + row for row in result.table.splitlines()]
    return "\n".join(lines)


def summary_line(results: Iterable[CheckResult], seconds: float, wall: float | None, width: int | None = None) -> str:
    """How many checks passed, failed, were skipped or gave a measurement, and how long it all took.

    Args:
        results: the checks' results.
        seconds: the time the checks took.
        wall: the wall time since the process started (imports included), or ``None`` if it is not known.
        width: the most characters a line may have (the terminal's width when ``None``).
    """
    results = list(results)
    counts = Counter(result.status for result in results)
    verdict = "FAILED" if counts["FAIL"] else "ok"
    took = (
        f"{seconds:.1f} s in the checks (the time since the process started is not known here)"
        if wall is None
        else f"{wall:.1f} s since the process started, imports included ({seconds:.1f} s in the checks)"
    )
    line = (
        f"{verdict}: {len(results)} checks: {counts['PASS']} passed, {counts['FAIL']} failed,"
        f" {counts['SKIP']} skipped, {counts['INFO']} measurement{'s' if counts['INFO'] != 1 else ''}; {took}"
    )
    return wrap(line, width or terminal_width())


def exit_code(results: Iterable[CheckResult]) -> int:
    """0 when every check that ran passed (or gave a measurement), 1 otherwise."""
    return 1 if any(result.status == "FAIL" for result in results) else 0


def json_document(
    env: Mapping[str, str], accelerator: str, results: list[CheckResult], seconds: float, wall: float | None
) -> dict[str, Any]:
    """What ``--json`` writes: the environment, the device, each check, the counts and the exit code.

    ``seconds`` is the time the checks took; ``wall_seconds`` the time since the process started (``None`` if not
    known).
    """
    counts = Counter(result.status for result in results)
    checks = [{k: v for k, v in asdict(result).items() if k != "table"} for result in results]
    document = {
        "schema": SCHEMA,
        "exit_code": exit_code(results),
        "accelerator": accelerator,
        "seconds": round(seconds, 3),
        "wall_seconds": None if wall is None else round(wall, 3),
        "environment": dict(env),
        "summary": {status: counts[status] for status in ("PASS", "FAIL", "SKIP", "INFO")},
        "checks": checks,
    }
    jsonable: dict[str, Any] = _jsonable(document)
    return jsonable


def _jsonable(value: Any) -> Any:
    """``value`` with what strict JSON lacks replaced: non-finite floats by None, sets and tuples by lists."""
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple | set):
        return [_jsonable(v) for v in (sorted(value) if isinstance(value, set) else value)]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if value is None or isinstance(value, bool | int | float | str):
        return value
    return str(value)
