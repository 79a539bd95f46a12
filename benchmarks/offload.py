"""What ``offload_to_cpu`` saves the caller: ``update`` time, a training loop's wall time, a tiny Metric, a GPU step.

Every figure is a ratio, offloaded to plain, measured side by side in one run: the ways run in a shuffled order in
each round, each round gives one ratio, and the script prints the median ratio over rounds with its interquartile
range (the machine's noise). Each part runs in a Python process of its own (see ``run_part_apart``), which first
allocates and frees 30 MiB (see ``_warm_up_allocator``), as a training process has freed something large before its
steps: no part's figures depend on the parts run before it. Each runs at ``--threads`` intra-op threads (default
1; the worker thread of ``offload_to_cpu`` uses the same number). Every offloaded Metric's value is checked equal
(``torch.equal``) to that of the same Metric run plainly on the same inputs; a mismatch is printed and the script
exits with 1.

1. CPU, heavy Metric: the caller's time in ``update`` for ``BinaryAUROC(thresholds=200)`` and
   ``MulticlassConfusionMatrix(num_classes=1000)`` at 100,000 and 1,000,000 predictions per batch, against the
   plain ``update``. Each round makes ``--calls`` calls: the offloaded Metric has room for all of them
   (``max_pending=calls``) and settles after them, outside the timed region; the figure is the median call.
   Reported apart: the queue full (``max_pending=1``), where every call after the first waits for the worker
   (backpressure: the bound does not change that steady state, only how many calls pass before it), and the
   worker's time per update (the burst and its settling, over the calls). The first ``update`` of an offloaded
   Metric starts the worker; it is reported in the notes.
   Goal: at most 0.05 with room in the queue.
2. CPU, a training loop: a small MLP's forward, backward and SGD step, with ``BinaryAUROC(thresholds=200)``
   updated on its predictions after the forward; sizes such that the update is about half of the inline step.
   The loop's wall time, ``compute`` at the end included, offloaded (default ``max_pending``) against inline.
   With one thread for the model, the worker has the second core to itself. The notes give the step without
   ``update`` both ways: the worker shares the process (the GIL, the allocator) with it. Goal: at most 0.75.
3. CPU, a tiny Metric: ``MeanMetric`` of a scalar, µs per ``update`` plain and offloaded, the caller's and in all
   (the updates and ``compute``, which waits for the worker): what offloading costs where there is nothing to save.
4. CPU, what the worker adds around each update, whatever the Metric: the caller's torch state applied, the guard
   that refuses a draw from a global torch generator (a dispatch mode: a cost per op the update runs), its warnings
   kept, Python's and NumPy's generators compared. An update's time as the worker runs it against the plain
   ``update``, both in the main thread, for Metrics of few large ops, many small ops, and a tiny one. No goal: it
   is time in the worker, off the caller, and costs the step only where the worker falls behind.
5. CPU, a launch-bound step: the training thread runs ``LAUNCH_OPS`` small ops a step (dispatcher-bound, as a host
   launching a GPU's kernels is), and updates a Metric whose update costs less than the step: a binned AUROC of
   1,000 predictions, and Metrics that run Python in ``update`` (word error rate, ROUGE; detection mAP where
   ``faster-coco-eval`` is installed). The time per step over ``LAUNCH_STEPS`` steps, the worker's queue waited
   for at the end, with the Metric inline, in a worker thread and in a worker process, against the step with no
   Metric. Reading the states back from the worker process (once an epoch in a fit) is reported apart. Goal: at
   most 1.10 offloaded.
6. GPU (only with CUDA): (a) the host syncs per ``update`` of an offloaded ``BinaryAUROC(thresholds=200)`` fed
   CUDA tensors, counted with ``torch.cuda.set_sync_debug_mode("warn")`` by the thread that made them, the first
   update apart (it makes the pinned buffers); (b) the device bytes of its states; (c) a launch-bound CUDA step
   (``GPU_OPS`` small kernels) with an offloaded ``BinaryAUROC(thresholds=200)`` of 10,000 predictions against
   the same step without a Metric, the device synchronised around each timed loop only. Goals: 0 syncs per update
   after the first, 0 device bytes, a step ratio of at most 1.02. Both workers.

    python benchmarks/offload.py [--rounds 9] [--calls 5] [--threads 1] [--parts heavy loop tiny guard launch gpu]
    python benchmarks/offload.py --quick   # small sizes, 2 rounds: checks the script itself
"""

import argparse
import os
import pickle
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torchmetrics
from _tables import add_docs_option, publish
from torch import Tensor
from torchmetrics import MeanMetric, Metric
from torchmetrics.classification import BinaryAUROC, MulticlassConfusionMatrix

from lightning_store import StoreOnCPUWarning, offload_to_cpu
from lightning_store.metrics._offload.caller_state import _CallerState
from lightning_store.metrics._offload.draws import _drawn, _host_states
from lightning_store.metrics._offload.inputs import _start_copies
from lightning_store.metrics._offload.process.inputs import _Outgoing
from lightning_store.metrics._offload.thread.queue import _as_at_the_call

GOAL_UPDATE, GOAL_LOOP, GOAL_LAUNCH, GOAL_STEP = 0.05, 0.75, 1.10, 1.02
GOAL_HANDOVER = 25e-6  # seconds: the caller's time per `update` of a tiny Metric, not a ratio
WORKERS = ("thread", "process")
PARTS = ("heavy", "loop", "tiny", "guard", "launch", "gpu")
_RUSAGE_THREAD = getattr(resource, "RUSAGE_THREAD", None)  # Linux only


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


def _minor_faults() -> int:
    return resource.getrusage(_RUSAGE_THREAD).ru_minflt if _RUSAGE_THREAD is not None else 0


def _settle(metric: Metric) -> None:
    metric._offload.settle()


def _shuffled(ways: list[str], rng: random.Random) -> list[str]:
    return rng.sample(ways, len(ways))


# 1. CPU, heavy Metric: the caller's time per update


def _binary(n: int, generator: torch.Generator) -> tuple[Tensor, Tensor]:
    return torch.rand(n, generator=generator), torch.randint(0, 2, (n,), generator=generator)


def _multiclass(n: int, generator: torch.Generator) -> tuple[Tensor, Tensor]:
    return torch.randint(0, 1000, (n,), generator=generator), torch.randint(0, 1000, (n,), generator=generator)


HEAVY: dict[str, tuple[Callable[[], Metric], Callable]] = {
    "BinaryAUROC(thresholds=200)": (lambda: BinaryAUROC(thresholds=200), _binary),
    "MulticlassConfusionMatrix(num_classes=1000)": (lambda: MulticlassConfusionMatrix(num_classes=1000), _multiclass),
}


def _timed_calls(metric: Metric, batches: list[tuple[Tensor, Tensor]]) -> tuple[list[float], int]:
    """The time of each ``update`` call, and the minor page faults of this thread over them."""
    times, faults = [], 0
    for preds, target in batches:
        before = _minor_faults()
        start = time.perf_counter()
        metric.update(preds, target)
        times.append(time.perf_counter() - start)
        faults += _minor_faults() - before
    return times, faults


def heavy(report: Report, rounds: int, calls: int, sizes: tuple[int, ...]) -> None:
    rng = random.Random(0)
    for name, (make, inputs) in HEAVY.items():
        for n in sizes:
            generator = torch.Generator().manual_seed(n)
            batches = [inputs(n, generator) for _ in range(calls)]
            what = f"{name}, {n:,} preds"
            room = Row("1", f"{what}: caller's `update`, queue with room", "ms", 1e3, GOAL_UPDATE)
            full = Row("1", f"{what}: caller's `update`, queue full (backpressure)", "ms", 1e3)
            worker = Row("1", f"{what}: worker's time per update (throughput)", "ms", 1e3)
            metrics = {
                "plain": make(),
                "room": offload_to_cpu(make(), max_pending=calls),
                "full": offload_to_cpu(make(), max_pending=1),
            }
            first: dict[str, float] = {}
            for way, metric in metrics.items():  # the same first batch for all; an offloaded one starts the worker
                start = time.perf_counter()
                metric.update(*batches[0])
                first[way] = time.perf_counter() - start
                if way != "plain":
                    _settle(metric)
            faults = 0
            for _ in range(rounds):
                per_way: dict[str, float] = {}
                for way in _shuffled(list(metrics), rng):
                    start = time.perf_counter()
                    times, way_faults = _timed_calls(metrics[way], batches)
                    if way == "plain":
                        per_way[way] = statistics.median(times)
                        continue
                    _settle(metrics[way])
                    if way == "room":
                        per_way["worker"] = (time.perf_counter() - start) / calls
                        faults += way_faults
                    per_way[way] = statistics.median(times if way == "room" else times[1:])
                for row, way in ((room, "room"), (full, "full"), (worker, "worker")):
                    row.base.append(per_way["plain"])
                    row.offloaded.append(per_way[way])
            report.rows += [room, full, worker]
            expected = metrics["plain"].compute()
            for way in ("room", "full"):
                report.check(f"{what}, queue {way}", metrics[way].compute(), expected)
            waits = metrics["full"]._offload.waits
            report.notes.append(
                f"{what}: the first offloaded `update` (the worker starting) took {first['room'] * 1e3:.1f} ms"
                f" ({first['room'] / statistics.median(room.base):.2f}x a plain update); with room, the caller's"
                f" minor page faults per update: {faults / (rounds * calls):.0f}; queue full: {waits} waits"
            )


# 2. CPU, a training loop: the model on one thread, the update beside it


LOOP_STEPS, LOOP_BATCH, LOOP_WIDTH, LOOP_FEATURES = 60, 8192, 96, 64


def _mlp(features: int, width: int) -> torch.nn.Module:
    layers = [torch.nn.Linear(features, width), torch.nn.ReLU(), torch.nn.Linear(width, width), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(width, 1))


def _run_loop(
    model: torch.nn.Module, initial: dict, metric: Metric, data: list[tuple[Tensor, Tensor]], steps: int
) -> tuple[float, float, float, Tensor]:
    """The wall time of ``steps`` steps and ``compute``, the time in ``update``, in ``compute``, and the value."""
    model.load_state_dict(initial)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    metric.reset()
    in_update = 0.0
    start = time.perf_counter()
    for step in range(steps):
        features, target = data[step % len(data)]
        logits = model(features).squeeze(-1)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, target.float())
        update_start = time.perf_counter()
        metric.update(logits.detach().sigmoid(), target)
        in_update += time.perf_counter() - update_start
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    compute_start = time.perf_counter()
    value = metric.compute()
    end = time.perf_counter()
    return end - start, in_update, end - compute_start, value


def loop(report: Report, rounds: int, steps: int, batch: int, width: int) -> None:
    generator = torch.Generator().manual_seed(1)
    data = [(torch.randn(batch, LOOP_FEATURES, generator=generator), torch.randint(0, 2, (batch,))) for _ in range(8)]
    model = _mlp(LOOP_FEATURES, width)
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    metrics = {"inline": BinaryAUROC(thresholds=200)}
    metrics |= {worker: offload_to_cpu(BinaryAUROC(thresholds=200), worker=worker) for worker in WORKERS}
    for metric in metrics.values():  # warm-up (a worker process starts)
        _run_loop(model, initial, metric, data, 2)
    what = f"training loop, {steps} steps + `compute`, batch {batch:,}, MLP width {width}"
    rows = {worker: Row("2", f"{what}: worker={worker!r}", "s", 1, GOAL_LOOP) for worker in WORKERS}
    share: list[float] = []
    rest: dict[str, list[float]] = {way: [] for way in metrics}  # the step without `update`, and `compute`
    computing: dict[str, list[float]] = {way: [] for way in metrics}
    queues = {worker: metrics[worker]._offload for worker in WORKERS}
    waits = {worker: queue.waits for worker, queue in queues.items()}
    rng = random.Random(1)
    for _ in range(rounds):
        walls, values = {}, {}
        for way in _shuffled(list(metrics), rng):
            walls[way], in_update, in_compute, values[way] = _run_loop(model, initial, metrics[way], data, steps)
            rest[way].append((walls[way] - in_update - in_compute) / steps)
            computing[way].append(in_compute)
            if way == "inline":
                share.append(in_update / walls[way])
        for worker, row in rows.items():
            row.base.append(walls["inline"])
            row.offloaded.append(walls[worker])
            report.check(f"training loop, {steps} steps, worker={worker!r}", values[worker], values["inline"])
    report.rows += rows.values()
    report.notes.append(
        f"training loop: `update` is {statistics.median(share):.0%} of the inline loop; `update` waited for room "
        + ", ".join(f"{queues[w].waits - waits[w]} times with worker={w!r}" for w in WORKERS)
        + f" in {rounds * steps} steps; the step without `update`, "
        + ", ".join(f"{way} {statistics.median(rest[way]) * 1e3:.1f} ms" for way in metrics)
        + "; `compute` at the end: "
        + ", ".join(f"{way} {statistics.median(computing[way]) * 1e3:.1f} ms" for way in metrics)
    )


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
    metrics = {"plain": plain} | {worker: offload_to_cpu(MeanMetric(), worker=worker) for worker in WORKERS}
    total = {
        worker: Row(
            "3", f"MeanMetric of a scalar: {updates:,} updates + `compute`, per update, worker={worker!r}", "µs", 1e6
        )
        for worker in WORKERS
    }
    for metric in metrics.values():
        metric.update(scalars[0])
        metric.compute()
    rng = random.Random(2)
    for _ in range(rounds):
        start = time.perf_counter()
        for i in range(updates):
            plain.update(scalars[i % len(scalars)])
        plain_update = (time.perf_counter() - start) / updates
        values, per_update = {}, {}
        for way in _shuffled(list(metrics), rng):
            metrics[way].reset()
            start = time.perf_counter()
            for i in range(updates):
                metrics[way].update(scalars[i % len(scalars)])
            values[way] = metrics[way].compute()
            per_update[way] = (time.perf_counter() - start) / updates
        for worker in WORKERS:
            handover[worker].base.append(plain_update)
            handover[worker].offloaded.append(_handed_over(worker, scalars, 100))
            total[worker].base.append(per_update["plain"])
            total[worker].offloaded.append(per_update[worker])
            report.check(f"MeanMetric, worker={worker!r}", values[worker], values["plain"])
    report.rows += [*handover.values(), *total.values()]
    report.notes.append(_handover_parts(scalars))


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
    message = ("update", 1, 1, "", _Outgoing((scalars[0],), {}).inputs, None)
    timed("process: the message pickled", lambda i: pickle.dumps(message, pickle.HIGHEST_PROTOCOL))
    timed("either: the torch state", lambda i: _CallerState())
    return "the hand-over's parts, per update: " + ", ".join(f"{k} {v * 1e6:.1f} µs" for k, v in timings.items())


# 4. What the worker adds around each update: the caller's torch state, the guard, the generators compared

GUARDED: dict[str, tuple[Callable[[], Metric], Callable, int]] = {
    "BinaryAUROC(thresholds=200), 100,000 predictions (a loop over thresholds)": (
        lambda: BinaryAUROC(thresholds=200),
        _binary,
        100_000,
    ),
    "BinaryAUROC(thresholds=200), 10,000 predictions": (lambda: BinaryAUROC(thresholds=200), _binary, 10_000),
    "MulticlassConfusionMatrix(num_classes=1000), 100,000 predictions": (
        lambda: MulticlassConfusionMatrix(num_classes=1000),
        _multiclass,
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
            for way in _shuffled(list(metrics), rng):
                metric = metrics[way]
                metric.reset()
                run = metric.update if way == "plain" else lambda *x, m=metric: _as_in_the_worker(m, x)
                start = time.perf_counter()
                for _ in range(updates):
                    run(*batch)
                (row.base if way == "plain" else row.offloaded).append((time.perf_counter() - start) / updates)
            report.check(name, metrics["as in the worker"].compute(), metrics["plain"].compute())
        report.rows.append(row)


# 5. CPU, a launch-bound step: many small ops in the training thread, as a host launching GPU kernels

LAUNCH_OPS, LAUNCH_STEPS = 1500, 150  # steps a measure: the worker's queue, waited for at the end, weighs little
_WORDS = [f"w{i}" for i in range(200)]


def _sentences(count: int, rng: random.Random) -> list[str]:
    return [" ".join(rng.choices(_WORDS, k=rng.randint(8, 20))) for _ in range(count)]


def _text_batch(count: int) -> Callable[[torch.Generator], tuple]:
    def make(generator: torch.Generator) -> tuple:
        rng = random.Random(int(torch.randint(0, 2**31, (), generator=generator)))
        return _sentences(count, rng), _sentences(count, rng)

    return make


def _detection_batch(generator: torch.Generator) -> tuple:
    def boxes(n: int) -> Tensor:
        xy = torch.rand(n, 2, generator=generator) * 80
        return torch.cat([xy, xy + 4 + torch.rand(n, 2, generator=generator) * 16], dim=1)

    preds = [
        {"boxes": boxes(20), "scores": torch.rand(20, generator=generator), "labels": torch.randint(0, 5, (20,))}
        for _ in range(8)
    ]
    target = [{"boxes": boxes(10), "labels": torch.randint(0, 5, (10,), generator=generator)} for _ in range(8)]
    return preds, target


def _launch_metrics() -> dict[str, tuple[Callable[[], Metric], Callable[[torch.Generator], tuple]]]:
    metrics: dict[str, tuple[Callable[[], Metric], Callable[[torch.Generator], tuple]]] = {
        "BinaryAUROC(thresholds=200), 1,000 predictions": (
            lambda: BinaryAUROC(thresholds=200),
            lambda generator: _binary(1000, generator),
        ),
        "WordErrorRate, 32 sentences (Python)": (torchmetrics.text.WordErrorRate, _text_batch(32)),
        "ROUGEScore (rouge1, rouge2, rougeL), 8 sentences (Python)": (
            lambda: torchmetrics.text.ROUGEScore(rouge_keys=("rouge1", "rouge2", "rougeL")),
            _text_batch(8),
        ),
    }
    try:
        import faster_coco_eval  # noqa: F401
        from torchmetrics.detection import MeanAveragePrecision

        metrics["MeanAveragePrecision (faster_coco_eval), 8 images"] = (
            lambda: MeanAveragePrecision(backend="faster_coco_eval"),
            _detection_batch,
        )
    except ImportError:
        pass
    return metrics


def _launch_bound_steps(metric: Metric | None, batches: list[tuple], steps: int) -> float:
    """The time per step of ``steps`` steps of ``LAUNCH_OPS`` small ops, a Metric updated in each, then settled."""
    x = torch.ones(16)
    start = time.perf_counter()
    for step in range(steps):
        y = x
        for _ in range(LAUNCH_OPS // 3):
            y = y.mul(1.0001).add(0.0001).relu()
        if metric is not None:
            metric.update(*batches[step % len(batches)])
    if metric is not None and hasattr(metric, "_offload"):
        metric._offload._wait()  # the updates the worker still has are the steps' work; reading the states is not
    return (time.perf_counter() - start) / steps


def launch(report: Report, rounds: int, steps: int) -> None:
    rng = random.Random(4)
    for name, (make, inputs) in _launch_metrics().items():
        generator = torch.Generator().manual_seed(4)
        batches = [inputs(generator) for _ in range(8)]
        ways: dict[str, Metric | None] = {"none": None, "inline": make()}
        ways |= {worker: offload_to_cpu(make(), worker=worker) for worker in WORKERS}
        for metric in ways.values():  # warm-up (a worker process starts)
            _launch_bound_steps(metric, batches, 3)
        rows = {
            way: Row(
                "5",
                f"launch-bound step, {name}: {way} vs no Metric",
                "ms",
                1e3,
                GOAL_LAUNCH if way != "inline" else None,
            )
            for way in ("inline", *WORKERS)
        }
        for _ in range(rounds):
            for metric in ways.values():
                if metric is not None:
                    metric.reset()
            per_way = {way: _launch_bound_steps(ways[way], batches, steps) for way in _shuffled(list(ways), rng)}
            for way, row in rows.items():
                row.base.append(per_way["none"])
                row.offloaded.append(per_way[way])
            for worker in WORKERS:
                report.check(f"{name}, {worker}", _flat_value(ways[worker]), _flat_value(ways["inline"]))
        report.rows += rows.values()
        process = ways["process"]
        assert process is not None
        _launch_bound_steps(process, batches, steps)
        start = time.perf_counter()
        _settle(process)
        report.notes.append(
            f"launch-bound step, {name}: reading the states back from the worker process after {steps} updates"
            f" (once an epoch in a fit; left out of the steps above) took {(time.perf_counter() - start) * 1e3:.1f} ms"
        )
    if "MeanAveragePrecision (faster_coco_eval), 8 images" not in _launch_metrics():
        report.notes.append("launch-bound step: MeanAveragePrecision left out: `pip install faster-coco-eval` adds it")


def _flat_value(metric: Metric | None) -> Tensor:
    """A Metric's value as one tensor (a dict of values, ROUGE's and mAP's, in key order)."""
    assert metric is not None
    value = metric.compute()
    if isinstance(value, dict):
        return torch.stack([value[key].float().reshape(-1)[0] for key in sorted(value)])
    return value


# 6. GPU


class SyncCounter:
    """Counts the host-device syncs torch warns of (``set_sync_debug_mode("warn")``), in this thread and others."""

    def __enter__(self) -> "SyncCounter":
        self.here = self.elsewhere = 0
        this_thread = threading.get_ident()
        self._catch = warnings.catch_warnings()
        self._catch.__enter__()
        warnings.simplefilter("always")

        def count(message, category, filename, lineno, file=None, line=None):
            if "synchroniz" in str(message):
                if threading.get_ident() == this_thread:
                    self.here += 1
                else:
                    self.elsewhere += 1

        warnings.showwarning = count
        torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc) -> None:
        torch.cuda.set_sync_debug_mode("default")
        self._catch.__exit__(*exc)


def _state_device_bytes(metric: Metric) -> int:
    total = 0
    for name in metric._defaults:
        value = getattr(metric, name)
        for tensor in value if isinstance(value, list) else [value]:
            total += 0 if tensor.is_cpu else tensor.numel() * tensor.element_size()
    return total


GPU_SYNC_UPDATES, GPU_STEPS, GPU_OPS = 50, 30, 600  # GPU_OPS: small kernels a step, launched by the host


def gpu(report: Report, rounds: int, quick: bool, device: torch.device) -> None:
    generator = torch.Generator(device=device).manual_seed(3)
    n = 10_000 if quick else 100_000
    batches = [
        (
            torch.rand(n, device=device, generator=generator),
            torch.randint(0, 2, (n,), device=device, generator=generator),
        )
        for _ in range(8)
    ]
    for worker in WORKERS:  # (a), (b): syncs and device bytes of an offloaded BinaryAUROC fed CUDA tensors
        metric = offload_to_cpu(BinaryAUROC(thresholds=200), worker=worker).to(device)  # as a module's `.to()`
        torch.cuda.synchronize(device)
        with SyncCounter() as first:
            metric.update(*batches[0])
        _settle(metric)
        with SyncCounter() as steady:
            for i in range(GPU_SYNC_UPDATES):
                metric.update(*batches[i % len(batches)])
        _settle(metric)  # a read waits for the copies: a sync, which `update` must not make
        oracle = BinaryAUROC(thresholds=200)
        for i in [0, *range(GPU_SYNC_UPDATES)]:
            oracle.update(*(t.cpu() for t in batches[i % len(batches)]))
        report.check(f"GPU, BinaryAUROC fed CUDA tensors, {worker}", metric.compute(), oracle.compute())
        report.gpu_notes.append(
            f"(a) worker={worker!r}: host syncs in the caller's thread: {first.here} in the first `update`,"
            f" {steady.here / GPU_SYNC_UPDATES:.2f} per update over the next {GPU_SYNC_UPDATES}; in the"
            f" worker thread meanwhile: {steady.elsewhere / GPU_SYNC_UPDATES:.2f} per update"
        )
        report.gpu_notes.append(
            f"(b) worker={worker!r}: device bytes of the offloaded Metric's states: {_state_device_bytes(metric)}"
        )
    on_device = BinaryAUROC(thresholds=200).to(device)
    on_device.update(*batches[0])
    report.gpu_notes.append(f"(b) the same Metric plainly on the device holds {_state_device_bytes(on_device)} bytes")

    # (c): a launch-bound step (the host launching many small kernels) with an offloaded Metric, against none
    steps = 5 if quick else GPU_STEPS
    x = torch.ones(256, device=device)
    pool = [(torch.rand(10_000, device=device, generator=generator), batches[i][1][:10_000]) for i in range(4)]

    def timed(metric: Metric | None) -> float:
        torch.cuda.synchronize(device)
        start = time.perf_counter()
        for step in range(steps):
            y = x
            for _ in range(GPU_OPS // 3):
                y = y.mul(1.0001).add(0.0001).relu()
            if metric is not None:
                metric.update(*pool[step % len(pool)])
        torch.cuda.synchronize(device)
        seconds = (time.perf_counter() - start) / steps
        if metric is not None and hasattr(metric, "_offload"):
            _settle(metric)  # outside the timed region
        return seconds

    make = lambda: BinaryAUROC(thresholds=200)  # noqa: E731
    ways: dict[str, Metric | None] = {"none": None, "inline": make().to(device)}
    ways |= {worker: offload_to_cpu(make(), worker=worker).to(device) for worker in WORKERS}
    for metric in ways.values():  # warm-up: kernels, the pinned buffers, the worker process
        timed(metric)
    rows = {
        way: Row(
            "6",
            f"GPU, launch-bound step ({GPU_OPS} kernels) + BinaryAUROC(200) of 10,000: {way} vs none",
            "ms",
            1e3,
            GOAL_STEP if way in WORKERS else None,
        )
        for way in ("inline", *WORKERS)
    }
    rng = random.Random(3)
    for _ in range(rounds):
        per_way = {way: timed(ways[way]) for way in _shuffled(list(ways), rng)}
        for way, row in rows.items():
            row.base.append(per_way["none"])
            row.offloaded.append(per_way[way])
    report.rows += rows.values()
    for worker in WORKERS:
        checked, oracle = ways[worker], make()
        assert checked is not None
        checked.reset()
        for preds, target in pool:
            checked.update(preds, target)
            oracle.update(preds.cpu(), target.cpu())
        report.check(f"GPU, BinaryAUROC, {worker}", checked.compute(), oracle.compute())


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
        if row.absolute_goal is not None:
            median = statistics.median(row.offloaded)
            found.append(
                f"part {row.part}, {row.what}: {median * row.scale:.3g} {row.unit} <= {row.absolute_goal * row.scale:g}"
                f" {row.unit}: {_met(median <= row.absolute_goal)}"
            )
    return found


def _met(met: bool) -> str:
    return "met" if met else "NOT met"


def _warm_up_allocator() -> None:
    """Allocate and free 30 MiB: glibc raises its mmap threshold, as any earlier large allocation would.

    Below it, freed memory is kept for the next allocation rather than handed back; without it, a Metric's
    temporaries of a few MiB page-fault afresh at every call in the main thread (not in the worker's arena) until
    something large has been freed, as it has been in a training process (its model, its first batches).
    """
    block = torch.empty(30 * 2**20, dtype=torch.uint8)
    del block


def run_parts(args: argparse.Namespace, report: Report) -> None:
    """Run the parts ``args`` name, in this process, into ``report``."""
    rounds = 2 if args.quick else max(args.rounds, 2)
    calls = 3 if args.quick else max(args.calls, 2)
    if "heavy" in args.parts:
        heavy(report, rounds, calls, (10_000, 100_000) if args.quick else (100_000, 1_000_000))
    if "loop" in args.parts:
        loop(report, rounds, *((5, 1024, 32) if args.quick else (LOOP_STEPS, LOOP_BATCH, LOOP_WIDTH)))
    if "tiny" in args.parts:
        tiny(report, rounds, 200 if args.quick else 2000)
    if "guard" in args.parts:
        guard(report, rounds, 3 if args.quick else 20)
    if "launch" in args.parts:
        launch(report, rounds, 10 if args.quick else LAUNCH_STEPS)
    if "gpu" in args.parts:
        if torch.cuda.is_available():
            gpu(report, rounds, args.quick, torch.device("cuda", torch.cuda.current_device()))
        else:
            print(f"GPU part skipped: torch.cuda.is_available() is False (torch {torch.__version__})")


def run_part_apart(args: argparse.Namespace, part: str, report: Report) -> None:
    """Run one part in a Python process of its own, and add what it measured to ``report``.

    A part's figures must not depend on the parts run before it. They did in one process: a part whose Metrics
    allocate large temporaries leaves glibc's heap with large free regions, and the first allocation of a few
    hundred bytes or more after a step of only small tensors then stalls for milliseconds, once in a while. A step
    with no Metric (the baseline of part 5) never makes one, and the offloaded steps beside it paid the stalls.
    """
    with tempfile.TemporaryDirectory() as directory:
        path = os.path.join(directory, "report.pickle")
        command = [sys.executable, __file__, "--parts", part, "--rounds", str(args.rounds), "--calls", str(args.calls)]
        command += ["--threads", str(args.threads), "--report-to", path] + (["--quick"] if args.quick else [])
        subprocess.run(command, check=True)
        with open(path, "rb") as file:
            done = pickle.load(file)
    report.rows += done.rows
    report.notes += done.notes
    report.gpu_notes += done.gpu_notes
    report.mismatches += done.mismatches


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--calls", type=int, default=5, help="heavy Metric: update calls a round")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads, process-wide")
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    parser.add_argument("--quick", action="store_true", help="small sizes, 2 rounds: checks the script itself")
    parser.add_argument("--report-to", help=argparse.SUPPRESS)  # run the parts here, pickle what they measured there
    add_docs_option(parser)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    os.environ["HELD"] = os.path.join(tempfile.mkdtemp(), "held")  # before a worker process starts: it reads it
    warnings.filterwarnings("ignore", category=StoreOnCPUWarning)  # the tight loops here fall behind on purpose
    report = Report()
    if args.report_to:
        _warm_up_allocator()
        run_parts(args, report)
        with open(args.report_to, "wb") as file:
            pickle.dump(report, file)
        return
    rounds = 2 if args.quick else max(args.rounds, 2)
    started = time.perf_counter()
    print(
        f"{time.strftime('%Y-%m-%d')}, torch {torch.__version__}, torchmetrics {torchmetrics.__version__},"
        f" {torch.get_num_threads()} intra-op thread(s); {rounds} rounds; `python {' '.join(sys.argv)}`\n"
    )
    for part in PARTS:
        if part in args.parts:
            run_part_apart(args, part, report)
    intro = [
        f"`benchmarks/offload.py`, {torch.get_num_threads()} torch thread(s), {rounds} rounds, each part in a process"
        " of its own: each ratio is the offloaded time over the baseline's, measured side by side in each round; its"
        " median, and in brackets the interquartile range over the rounds.",
        "",
    ]
    gpu_rows = [row for row in report.rows if row.part == "6"]
    write = not (args.quick or args.no_docs)
    cpu_rows = [r for r in report.rows if r.part != "6"]
    publish("offload_cpu", intro + table(cpu_rows), report.notes, goals=goals(cpu_rows), write=write)
    if gpu_rows:
        publish("offload_gpu", intro + table(gpu_rows), report.gpu_notes, goals=goals(gpu_rows), write=write)
    print(f"\ntotal {time.perf_counter() - started:.0f} s")
    if report.mismatches:
        print(f"\n{len(report.mismatches)} VALUE MISMATCH(ES): see above", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
