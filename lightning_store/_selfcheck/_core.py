"""The self-check's building blocks: a check, its outcome, and the runner that never lets one check stop the rest."""

import time
import traceback
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

Status = Literal["PASS", "FAIL", "SKIP", "INFO"]


class Skip(Exception):
    """Raised by a check that cannot run here; its message is the reason."""


@dataclass
class Outcome:
    """What a check found: ``PASS`` or ``FAIL``, or ``INFO`` for a measurement; ``data`` is for ``--json``."""

    status: Status
    detail: str
    data: dict[str, Any] = field(default_factory=dict)
    table: str = ""  # printed under the check's line, indented


@dataclass
class Context:
    """What every check gets: the accelerator to run on and a temporary directory for the fits.

    Attributes:
        accelerator: ``"cuda"``, ``"mps"`` or ``"cpu"``.
        root: a temporary directory, removed after the run: the fits' ``default_root_dir``.
    """

    accelerator: str
    root: Path
    _memo: dict[str, Any] = field(default_factory=dict)

    def once(self, key: str, compute: Callable[[], Any]) -> Any:
        """``compute()``, run once per key and shared by the checks that need it (an exception too)."""
        if key not in self._memo:
            try:
                self._memo[key] = (True, compute())
            except Exception as err:
                self._memo[key] = (False, err)
        ok, value = self._memo[key]
        if not ok:
            raise value
        return value


@dataclass(frozen=True)
class Check:
    """A named check: ``run`` returns an :class:`Outcome` or raises :class:`Skip`; any other exception is a FAIL."""

    id: str
    title: str
    run: Callable[[Context], Outcome]


@dataclass
class CheckResult:
    """One line of the self-check's output."""

    id: str
    title: str
    status: Status
    detail: str
    seconds: float
    data: dict[str, Any]
    table: str = ""


def run_checks(checks: Iterable[Check], context: Context) -> list[CheckResult]:
    """Run every check in order; an exception inside one is its FAIL, with its message, and the next one runs."""
    return [run_check(check, context) for check in checks]


def run_check(check: Check, context: Context) -> CheckResult:
    """Run ``check``: its outcome, a SKIP with the reason it raised, or a FAIL with the exception it raised."""
    started = time.perf_counter()
    try:
        outcome = check.run(context)
    except Skip as skip:
        outcome = Outcome("SKIP", str(skip))
    except Exception as err:
        outcome = Outcome("FAIL", f"{type(err).__name__}: {err}", {"traceback": traceback.format_exc()})
    seconds = round(time.perf_counter() - started, 3)
    return CheckResult(check.id, check.title, outcome.status, outcome.detail, seconds, outcome.data, outcome.table)
