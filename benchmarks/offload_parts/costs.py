"""Parts 3 and 4 of ``benchmarks/offload.py``: what offloading costs a tiny Metric; what a worker adds to an update."""

import os
import pickle
import random
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torchmetrics import MeanMetric, Metric
from torchmetrics.classification import BinaryAUROC, MulticlassAccuracy, MulticlassConfusionMatrix

from lightning_store import offload_to_cpu

# what these parts time is the worker's own work, which has no public API: each piece from its module
from lightning_store.metrics._offload.caller_state import _CallerState
from lightning_store.metrics._offload.draws import _drawn, _host_states
from lightning_store.metrics._offload.inputs import _start_copies
from lightning_store.metrics._offload.process.inputs import _Outgoing
from lightning_store.metrics._offload.process.messages import _Updates, _wire
from lightning_store.metrics._offload.thread.queue import _as_at_the_call
from offload_parts.report import WORKERS, Report, Row, shuffled
from offload_parts.saves import binary, multiclass

GOAL_HANDOVER = 25e-6  # seconds: a tiny Metric's hand-over, and the worker's time added to its update, not a ratio


# 3. CPU, a tiny Metric


class Held(MeanMetric):
    """A ``MeanMetric`` whose update waits while the file ``HELD`` names exists: it holds its worker."""

    def update(self, *args: Any, **kwargs: Any) -> None:
        while os.path.exists(os.environ["HELD"]):
            time.sleep(0.001)
        super().update(*args, **kwargs)


def _handed_over(worker: str, scalars: list[Tensor], updates: int) -> float:
    """The caller's time per ``update`` of a ``MeanMetric`` with room in its queue, the worker held meanwhile.

    ``updates`` is small enough for a worker process's pipe to take them all while it does not read.
    """
    held = offload_to_cpu(Held(), worker=worker)
    metric = offload_to_cpu(MeanMetric(), worker=worker, max_pending=updates)
    metric.update(scalars[0])
    metric.compute()
    with open(os.environ["HELD"], "w"):
        pass
    held.update(scalars[0])  # the worker waits in it: the updates below only queue
    start = time.perf_counter()
    for i in range(updates):
        metric.update(scalars[i % len(scalars)])
    seconds = (time.perf_counter() - start) / updates
    os.remove(os.environ["HELD"])
    held.compute()
    metric.compute()
    return seconds


def tiny(report: Report, rounds: int, updates: int) -> None:
    generator = torch.Generator().manual_seed(2)
    scalars = [torch.rand((), generator=generator) for _ in range(64)]
    plain = MeanMetric()
    handover = {
        worker: Row("3", f"MeanMetric of a scalar: the caller's `update`, worker={worker!r} held", "µs", 1e6)
        for worker in WORKERS
    }
    for row in handover.values():
        row.absolute_goal = GOAL_HANDOVER
    sustained = {
        "MeanMetric of a scalar": (MeanMetric, [(scalar,) for scalar in scalars]),
        "MulticlassAccuracy(10) of 64": (
            lambda: MulticlassAccuracy(10),
            [
                (torch.randn(64, 10, generator=generator), torch.randint(0, 10, (64,), generator=generator))
                for _ in range(64)
            ],
        ),
    }
    total = [
        row
        for name, (make, batches) in sustained.items()
        for row in _sustained(name, make, batches, rounds, updates, report)
    ]
    for _ in range(rounds):
        start = time.perf_counter()
        for i in range(updates):
            plain.update(scalars[i % len(scalars)])
        plain_update = (time.perf_counter() - start) / updates
        for worker in WORKERS:
            handover[worker].base.append(plain_update)
            handover[worker].offloaded.append(_handed_over(worker, scalars, 100))
    report.rows += [*handover.values(), *total]
    report.notes.append(_handover_parts(scalars))


def _sustained(
    name: str, make: Callable[[], Metric], batches: list[tuple], rounds: int, updates: int, report: Report
) -> list[Row]:
    """Updates back to back, then ``compute``: the time per update offloaded against plain, by worker.

    The worker's own cost per update shows here: the caller does nothing else, and waits for the worker.
    """
    metrics = {"plain": make()} | {worker: offload_to_cpu(make(), worker=worker) for worker in WORKERS}
    rows = {
        worker: Row("3", f"{name}: {updates:,} updates + `compute`, per update, worker={worker!r}", "µs", 1e6)
        for worker in WORKERS
    }
    for row in rows.values():
        row.added_goal = GOAL_HANDOVER
    for metric in metrics.values():
        metric.update(*batches[0])
        metric.compute()
    rng = random.Random(2)
    for _ in range(rounds):
        values, per_update = {}, {}
        for way in shuffled(list(metrics), rng):
            metrics[way].reset()
            start = time.perf_counter()
            for i in range(updates):
                metrics[way].update(*batches[i % len(batches)])
            values[way] = metrics[way].compute()
            per_update[way] = (time.perf_counter() - start) / updates
        for worker in WORKERS:
            rows[worker].base.append(per_update["plain"])
            rows[worker].offloaded.append(per_update[worker])
            report.check(f"{name}, worker={worker!r}", values[worker], values["plain"])
    return list(rows.values())


def _handover_parts(scalars: list[Tensor]) -> str:
    """Where the hand-over goes, part by part; the rest of the caller's time is the queue (lock, wake-up, pipe).

    The input's copy (a worker thread) or its bytes (a worker process), the message pickled, the torch state.
    """
    count = 2000
    timings: dict[str, float] = {}

    def timed(what: str, run: Callable[[int], Any]) -> None:
        start = time.perf_counter()
        for i in range(count):
            run(i)
        timings[what] = (time.perf_counter() - start) / count

    timed("thread: the input's copy", lambda i: _start_copies((scalars[i % len(scalars)],), {}))
    timed("process: the input's bytes", lambda i: _Outgoing((scalars[i % len(scalars)],), {}))
    inputs = _Outgoing((scalars[0],), {}).pickled("MeanMetric")  # a whole CPU tensor: its bytes, with the message
    timed(
        "process: the message pickled",
        lambda i: pickle.dumps(_wire(_Updates([(1, 1, "", inputs, None)], 1)), pickle.HIGHEST_PROTOCOL),
    )
    timed("either: the torch state", lambda i: _CallerState())
    return "the hand-over's parts, per update: " + ", ".join(f"{k} {v * 1e6:.1f} µs" for k, v in timings.items())


# 4. What the worker adds around each update: the caller's torch state, the guard, the generators compared

GUARDED: dict[str, tuple[Callable[[], Metric], Callable, int]] = {
    "BinaryAUROC(thresholds=200), 100,000 predictions (a loop over thresholds)": (
        lambda: BinaryAUROC(thresholds=200),
        binary,
        100_000,
    ),
    "BinaryAUROC(thresholds=200), 10,000 predictions": (lambda: BinaryAUROC(thresholds=200), binary, 10_000),
    "MulticlassConfusionMatrix(num_classes=1000), 100,000 predictions": (
        lambda: MulticlassConfusionMatrix(num_classes=1000),
        multiclass,
        100_000,
    ),
    "MeanMetric of a scalar": (MeanMetric, lambda n, generator: (torch.rand((), generator=generator),), 1),
}


def _as_in_the_worker(metric: Metric, inputs: tuple) -> None:
    """``metric.update`` as the worker runs an update (in this thread, so that nothing else runs meanwhile)."""
    before = _host_states()
    with _as_at_the_call(_CallerState()):
        metric.update(*inputs)
    _drawn(before, _host_states())


def guard(report: Report, rounds: int, updates: int) -> None:
    rng = random.Random(3)
    for name, (make, inputs, n) in GUARDED.items():
        batch = inputs(n, torch.Generator().manual_seed(3))
        row = Row("4", f"{name}: the worker's time per update, with what it adds", "µs", 1e6)
        metrics = {"plain": make(), "as in the worker": make()}
        for _ in range(rounds):
            for way in shuffled(list(metrics), rng):
                metric = metrics[way]
                metric.reset()
                run = metric.update if way == "plain" else lambda *x, m=metric: _as_in_the_worker(m, x)
                start = time.perf_counter()
                for _ in range(updates):
                    run(*batch)
                (row.base if way == "plain" else row.offloaded).append((time.perf_counter() - start) / updates)
            report.check(name, metrics["as in the worker"].compute(), metrics["plain"].compute())
        report.rows.append(row)
