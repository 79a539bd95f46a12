"""Part 5 of ``benchmarks/offload.py``: a launch-bound step (many small ops) beside an offloaded Metric."""

import random
import time
from collections.abc import Callable

import torch
import torchmetrics
from torch import Tensor
from torchmetrics import Metric
from torchmetrics.classification import BinaryAUROC, MulticlassConfusionMatrix

from lightning_store import offload_to_cpu
from lightning_store.metrics._reads import _is_offloaded, _queue_of  # waiting for the updates, not the states back
from offload_parts.report import WORKERS, Report, Row, settle, shuffled
from offload_parts.saves import binary, multiclass

GOAL_LAUNCH = 1.10  # the step with the Metric offloaded, against the step without it
GOAL_SHORT = 0.75  # a step shorter than the update: the step with the Metric offloaded, against it inline


# 5. CPU, a launch-bound step: many small ops in the training thread, as a host launching GPU kernels

LAUNCH_OPS, LAUNCH_STEPS = 1500, 150  # steps a measure: the worker's queue, waited for at the end, weighs little
WARM_UP_STEPS = 20  # steps run, and waited for, before each measure: it starts from that way's own state
SHORT_OPS = LAUNCH_OPS // 8  # a step the binned AUROC's update takes longer than
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


_Case = tuple[Callable[[], Metric], Callable[[torch.Generator], tuple], int]  # the Metric, its inputs, ops a step


def _launch_metrics() -> dict[str, _Case]:
    metrics: dict[str, _Case] = {
        "BinaryAUROC(thresholds=200), 1,000 predictions": (
            lambda: BinaryAUROC(thresholds=200),
            lambda generator: binary(1000, generator),
            LAUNCH_OPS,
        ),
        "BinaryAUROC(thresholds=200), 1,000 predictions, a step shorter than the update": (
            lambda: BinaryAUROC(thresholds=200),
            lambda generator: binary(1000, generator),
            SHORT_OPS,
        ),
        "MulticlassConfusionMatrix(1000), 10,000 predictions": (
            lambda: MulticlassConfusionMatrix(1000),
            lambda generator: multiclass(10_000, generator),
            LAUNCH_OPS,
        ),
        "WordErrorRate, 32 sentences (Python)": (torchmetrics.text.WordErrorRate, _text_batch(32), LAUNCH_OPS),
        "ROUGEScore (rouge1, rouge2, rougeL), 8 sentences (Python)": (
            lambda: torchmetrics.text.ROUGEScore(rouge_keys=("rouge1", "rouge2", "rougeL")),
            _text_batch(8),
            LAUNCH_OPS,
        ),
    }
    try:
        import faster_coco_eval  # noqa: F401
        from torchmetrics.detection import MeanAveragePrecision

        metrics["MeanAveragePrecision (faster_coco_eval), 8 images"] = (
            lambda: MeanAveragePrecision(backend="faster_coco_eval"),
            _detection_batch,
            LAUNCH_OPS,
        )
    except ImportError:
        pass
    return metrics


def _launch_bound_steps(
    metric: Metric | None, batches: list[tuple], steps: int, ops: int = LAUNCH_OPS, warm_up: int = 0
) -> float:
    """The time per step of ``steps`` steps of ``ops`` small ops, a Metric updated in each, then settled.

    ``warm_up`` steps run first, untimed, and their updates are waited for: what the last measure left (in the
    allocator, the caches) is not counted in this one.
    """
    if warm_up:
        _launch_bound_steps(metric, batches, warm_up, ops)
    x = torch.ones(16)
    start = time.perf_counter()
    for step in range(steps):
        y = x
        for _ in range(ops // 3):
            y = y.mul(1.0001).add(0.0001).relu()
        if metric is not None:
            metric.update(*batches[step % len(batches)])
    if metric is not None and _is_offloaded(metric):
        _queue_of(metric)._wait()  # the updates the worker still has are the steps' work; reading the states is not
    return (time.perf_counter() - start) / steps


def launch(report: Report, rounds: int, steps: int, only: int | None = None) -> None:
    """Measure part 5 into ``report``: each Metric of :func:`_launch_metrics`, or only the one at index ``only``."""
    rng = random.Random(4)
    for index, (name, (make, inputs, ops)) in enumerate(_launch_metrics().items()):
        if only is not None and index != only:
            continue
        generator = torch.Generator().manual_seed(4)
        batches = [inputs(generator) for _ in range(8)]
        ways: dict[str, Metric | None] = {"none": None, "inline": make()}
        ways |= {worker: offload_to_cpu(make(), worker=worker) for worker in WORKERS}
        for metric in ways.values():  # warm-up (a worker process starts)
            _launch_bound_steps(metric, batches, 3, ops)
        short = ops < LAUNCH_OPS  # the update takes longer than the step: offloading must save most of it
        rows = {
            way: Row(
                "5",
                f"launch-bound step, {name}: {way} vs no Metric",
                "ms",
                1e3,
                GOAL_LAUNCH if way != "inline" and not short else None,
            )
            for way in ("inline", *WORKERS)
        }
        against_inline = {
            worker: Row("5", f"launch-bound step, {name}: {worker} vs inline", "ms", 1e3, GOAL_SHORT)
            for worker in (WORKERS if short else ())
        }
        for _ in range(rounds):
            for metric in ways.values():
                if metric is not None:
                    metric.reset()
            per_way = {
                way: _launch_bound_steps(ways[way], batches, steps, ops, warm_up=min(WARM_UP_STEPS, steps))
                for way in shuffled(list(ways), rng)
            }
            for way, row in rows.items():
                row.base.append(per_way["none"])
                row.offloaded.append(per_way[way])
            for worker, row in against_inline.items():
                row.base.append(per_way["inline"])
                row.offloaded.append(per_way[worker])
            for worker in WORKERS:
                report.check(f"{name}, {worker}", _flat_value(ways[worker]), _flat_value(ways["inline"]))
        report.rows += [*rows.values(), *against_inline.values()]
        process = ways["process"]
        assert process is not None
        _launch_bound_steps(process, batches, steps, ops)
        start = time.perf_counter()
        settle(process)
        report.notes.append(
            f"launch-bound step, {name}: reading the states back from the worker process after {steps} updates"
            f" (once an epoch in a fit; left out of the steps above) took {(time.perf_counter() - start) * 1e3:.1f} ms"
        )
    if only in (None, 0) and "MeanAveragePrecision (faster_coco_eval), 8 images" not in _launch_metrics():
        report.notes.append("launch-bound step: MeanAveragePrecision left out: `pip install faster-coco-eval` adds it")


def _flat_value(metric: Metric | None) -> Tensor:
    """A Metric's value as one tensor (a dict of values, ROUGE's and mAP's, in key order)."""
    assert metric is not None
    value = metric.compute()
    if isinstance(value, dict):
        return torch.stack([value[key].float().reshape(-1)[0] for key in sorted(value)])
    return value
