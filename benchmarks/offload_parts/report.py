"""The rows that the parts of ``benchmarks/offload.py`` measure, their values checked, and the table and goals."""

import random
import statistics
import sys
from dataclasses import dataclass, field

import torch
from torch import Tensor
from torchmetrics import Metric

from lightning_store.metrics._reads import _queue_of  # waiting for the updates alone: no public API does

WORKERS = ("thread", "process")


@dataclass
class Row:
    """One line of the table: a figure per round for the baseline and the offloaded way."""

    part: str
    what: str
    unit: str
    scale: float
    goal: float | None = None
    base: list[float] = field(default_factory=list)
    absolute_goal: float | None = None  # in seconds, against the offloaded median, where a ratio is not the goal
    added_goal: float | None = None  # in seconds, against the median over rounds of offloaded less baseline
    worst_goal: float | None = None  # against the largest ratio of a round, where each round must meet a bound
    offloaded: list[float] = field(default_factory=list)


@dataclass
class Report:
    rows: list[Row] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    gpu_notes: list[str] = field(default_factory=list)
    mismatches: list[str] = field(default_factory=list)

    def check(self, what: str, got: Tensor, expected: Tensor) -> None:
        """Record (and print at once) a value of an offloaded Metric that differs from the plain Metric's."""
        if not torch.equal(got, expected):
            message = f"VALUE MISMATCH, {what}: offloaded {got.tolist()} != plain {expected.tolist()}"
            print(message, file=sys.stderr, flush=True)
            self.mismatches.append(message)


def quartiles(values: list[float]) -> tuple[float, float, float]:
    if len(values) < 2:
        return values[0], values[0], values[0]
    q1, median, q3 = statistics.quantiles(values, n=4)
    return q1, median, q3


def shuffled(ways: list[str], rng: random.Random) -> list[str]:
    return rng.sample(ways, len(ways))


def table(rows: list[Row]) -> list[str]:
    """The rows as a markdown table."""
    lines = [
        "| part | measurement | baseline | offloaded | ratio (IQR) |",
        "| --- | --- | --- | --- | --- |",
    ]
    for row in rows:
        ratios = [o / b for o, b in zip(row.offloaded, row.base, strict=True)]
        q1, ratio, q3 = quartiles(ratios)
        base, off = (statistics.median(values) * row.scale for values in (row.base, row.offloaded))
        lines.append(
            f"| {row.part} | {row.what} | {base:.3g} {row.unit} | {off:.3g} {row.unit} | {ratio:.3f}"
            f" ({q1:.2f}-{q3:.2f}) |"
        )
    return lines


def goals(rows: list[Row]) -> list[str]:
    """Each row's goal (CONTRIBUTING.md), and whether this run met it."""
    found = []
    for row in rows:
        ratio = quartiles([o / b for o, b in zip(row.offloaded, row.base, strict=True)])[1]
        if row.goal is not None:
            found.append(f"part {row.part}, {row.what}: ratio {ratio:.3f} <= {row.goal}: {_met(ratio <= row.goal)}")
        if row.worst_goal is not None:
            worst = max(o / b for o, b in zip(row.offloaded, row.base, strict=True))
            found.append(
                f"part {row.part}, {row.what}: every round, ratio at most {worst:.3f} <= {row.worst_goal}:"
                f" {_met(worst <= row.worst_goal)}"
            )
        if row.absolute_goal is not None:
            median = statistics.median(row.offloaded)
            found.append(
                f"part {row.part}, {row.what}: {median * row.scale:.3g} {row.unit} <= {row.absolute_goal * row.scale:g}"
                f" {row.unit}: {_met(median <= row.absolute_goal)}"
            )
        if row.added_goal is not None:
            added = statistics.median(o - b for o, b in zip(row.offloaded, row.base, strict=True))
            found.append(
                f"part {row.part}, {row.what}: {added * row.scale:+.3g} {row.unit} over the baseline <="
                f" {row.added_goal * row.scale:g} {row.unit}: {_met(added <= row.added_goal)}"
            )
    return found


def _met(met: bool) -> str:
    return "met" if met else "NOT met"


def settle(metric: Metric) -> None:
    """Wait for the updates queued on an offloaded ``metric``, as every read of its states does."""
    metric.metric_state  # noqa: B018  (read for its wait: a worker process's states come back)


def wait_for_updates(metric: Metric) -> None:
    """Wait until the updates queued on an offloaded ``metric`` have run, without reading its states back.

    A worker process keeps its copy's states, as between a fit's reads (one an epoch): the next update is not
    preceded by the Metric sent again, as it is after :func:`settle`.
    """
    _queue_of(metric)._wait()
