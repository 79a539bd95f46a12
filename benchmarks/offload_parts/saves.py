"""Parts 1 and 2 of ``benchmarks/offload.py``: what offloading saves the caller of a heavy Metric; a training loop."""

import random
import resource
import statistics
import time
from collections.abc import Callable

import torch
from torch import Tensor
from torchmetrics import Metric
from torchmetrics.classification import BinaryAUROC, MulticlassConfusionMatrix

from lightning_store import offload_to_cpu
from lightning_store.metrics._reads import _queue_of  # the queue's counters: no public API says how often it waited
from offload_parts.report import WORKERS, Report, Row, shuffled, wait_for_updates

GOAL_UPDATE, GOAL_LOOP, GOAL_LOOP_WORST = 0.05, 0.75, 0.85  # the loop: its median, and every round
_RUSAGE_THREAD = getattr(resource, "RUSAGE_THREAD", None)  # Linux only


def _minor_faults() -> int:
    return resource.getrusage(_RUSAGE_THREAD).ru_minflt if _RUSAGE_THREAD is not None else 0


# 1. CPU, heavy Metric: the caller's time per update


def binary(n: int, generator: torch.Generator) -> tuple[Tensor, Tensor]:
    return torch.rand(n, generator=generator), torch.randint(0, 2, (n,), generator=generator)


def multiclass(n: int, generator: torch.Generator) -> tuple[Tensor, Tensor]:
    return torch.randint(0, 1000, (n,), generator=generator), torch.randint(0, 1000, (n,), generator=generator)


HEAVY: dict[str, tuple[Callable[[], Metric], Callable]] = {
    "BinaryAUROC(thresholds=200)": (lambda: BinaryAUROC(thresholds=200), binary),
    "MulticlassConfusionMatrix(num_classes=1000)": (lambda: MulticlassConfusionMatrix(num_classes=1000), multiclass),
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
            rows: dict[str, Row] = {}
            metrics = {"plain": make()}
            for worker in WORKERS:
                on = f"{what}, worker {worker}"
                rows[f"{worker} room"] = Row("1", f"{on}: caller's `update`, queue with room", "ms", 1e3, GOAL_UPDATE)
                rows[f"{worker} full"] = Row("1", f"{on}: caller's `update`, queue full (backpressure)", "ms", 1e3)
                rows[f"{worker} worker"] = Row("1", f"{on}: worker's time per update (throughput)", "ms", 1e3)
                metrics[f"{worker} room"] = offload_to_cpu(make(), max_pending=calls, worker=worker)
                metrics[f"{worker} full"] = offload_to_cpu(make(), max_pending=1, worker=worker)
            first: dict[str, float] = {}
            for way, metric in metrics.items():  # the same first batch for all; an offloaded one starts the worker
                start = time.perf_counter()
                metric.update(*batches[0])
                first[way] = time.perf_counter() - start
                if way != "plain":
                    wait_for_updates(metric)
            faults = dict.fromkeys(WORKERS, 0)
            for _ in range(rounds):
                per_way: dict[str, float] = {}
                for way in shuffled(list(metrics), rng):
                    start = time.perf_counter()
                    times, way_faults = _timed_calls(metrics[way], batches)
                    if way == "plain":
                        per_way[way] = statistics.median(times)
                        continue
                    wait_for_updates(metrics[way])
                    worker, queue = way.split()
                    if queue == "room":
                        per_way[f"{worker} worker"] = (time.perf_counter() - start) / calls
                        faults[worker] += way_faults
                    per_way[way] = statistics.median(times if queue == "room" else times[1:])
                for way, row in rows.items():
                    row.base.append(per_way["plain"])
                    row.offloaded.append(per_way[way])
            report.rows += rows.values()
            expected = metrics["plain"].compute()
            for way, metric in metrics.items():
                if way != "plain":
                    report.check(f"{what}, {way}", metric.compute(), expected)
            for worker in WORKERS:
                started = first[f"{worker} room"]
                plain = statistics.median(rows[f"{worker} room"].base)
                waits = _queue_of(metrics[f"{worker} full"]).waits
                report.notes.append(
                    f"{what}, worker {worker}: the first offloaded `update` (the worker starting) took"
                    f" {started * 1e3:.1f} ms ({started / plain:.2f}x"
                    f" a plain update); with room, the caller's minor page faults per update:"
                    f" {faults[worker] / (rounds * calls):.0f}; queue full: {waits} waits"
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
    rows = {
        worker: Row("2", f"{what}: worker={worker!r}", "s", 1, GOAL_LOOP, worst_goal=GOAL_LOOP_WORST)
        for worker in WORKERS
    }
    share: list[float] = []
    rest: dict[str, list[float]] = {way: [] for way in metrics}  # the step without `update`, and `compute`
    computing: dict[str, list[float]] = {way: [] for way in metrics}
    queues = {worker: _queue_of(metrics[worker]) for worker in WORKERS}
    waits = {worker: queue.waits for worker, queue in queues.items()}
    rng = random.Random(1)
    for _ in range(rounds):
        walls, values = {}, {}
        for way in shuffled(list(metrics), rng):
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
