"""Part 5 of ``benchmarks/offload.py``: a launch-bound step (many small ops) beside an offloaded Metric."""

import contextlib
import functools
import random
import statistics
import time
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torchmetrics
from torch import Tensor
from torchmetrics import Metric
from torchmetrics.classification import BinaryAUROC, MulticlassConfusionMatrix

from lightning_store import StoreOnCPUWarning, offload_to_cpu
from lightning_store._selfcheck._way import Way  # each way in a fresh process, as the self-check runs them
from lightning_store.metrics._offload.process.child import _keep_freed_memory  # as a training process has
from lightning_store.metrics._reads import _is_offloaded
from offload_parts.report import WORKERS, Report, Row, settle, shuffled, wait_for_updates
from offload_parts.saves import binary, multiclass

GOAL_LAUNCH = 1.10  # the step with the Metric offloaded, against the step without it
GOAL_SHORT = 0.75  # a step shorter than the update: the step with the Metric offloaded, against it inline


# 5. CPU, a launch-bound step: many small ops in the training thread, as a host launching GPU kernels

LAUNCH_OPS, LAUNCH_STEPS = 1500, 150  # steps a measure: the worker's queue, waited for at the end, weighs little
WARM_UP_STEPS = 20  # steps run, and waited for, before each measure: it starts from that way's own state
READS = 5  # of the states back, each after its own updates: one may take a full pass of Python's garbage collector
SHORT_OPS = LAUNCH_OPS // 8  # a step the binned AUROC's update takes longer than
MODEL_LAYERS, MODEL_WIDTH = 80, 32  # a training step about as long as the step of `LAUNCH_OPS` (3.3 ms, 2 CPUs)
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
        {
            "boxes": boxes(20),
            "scores": torch.rand(20, generator=generator),
            "labels": torch.randint(0, 5, (20,), generator=generator),
        }
        for _ in range(8)
    ]
    target = [{"boxes": boxes(10), "labels": torch.randint(0, 5, (10,), generator=generator)} for _ in range(8)]
    return preds, target


class _Case(NamedTuple):
    make: Callable[[], Metric]
    inputs: Callable[[torch.Generator], tuple]
    ops: int  # small ops a step: ``ops // 3`` rounds of three on one tensor of 16 elements
    layers: int = 0  # else, a training step of an MLP this deep (see ``_Model``)


class _Model:
    """A training step of a deep, narrow MLP on 4 samples: small ops, over 0.8 MB of weights, gradients, activations.

    The step of ``ops`` on one small tensor keeps its data in the core's own cache, which an update run at the same
    time on the other core, over MBs of its own (a confusion matrix's 8 MB of counts), does not touch; this step's
    data is in the cache the cores share. The weights do not change (SGD with a learning rate of 0, its ops run all
    the same), so every step and way computes the same.
    """

    def __init__(self, layers: int) -> None:
        generator = torch.Generator().manual_seed(5)
        modules: list[torch.nn.Module] = []
        for _ in range(layers):
            linear = torch.nn.Linear(MODEL_WIDTH, MODEL_WIDTH)
            torch.nn.init.orthogonal_(linear.weight, generator=generator)  # activations neither vanish nor blow up
            modules += [linear, torch.nn.Tanh()]
        self.model = torch.nn.Sequential(*modules, torch.nn.Linear(MODEL_WIDTH, 1))
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.0)
        self.x = torch.randn(4, MODEL_WIDTH, generator=generator)

    def step(self) -> None:
        loss = self.model(self.x).square().mean()
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()


def _launch_metrics() -> dict[str, _Case]:
    metrics: dict[str, _Case] = {
        "BinaryAUROC(thresholds=200), 1,000 predictions": _Case(
            lambda: BinaryAUROC(thresholds=200),
            lambda generator: binary(1000, generator),
            LAUNCH_OPS,
        ),
        "BinaryAUROC(thresholds=200), 1,000 predictions, a step shorter than the update": _Case(
            lambda: BinaryAUROC(thresholds=200),
            lambda generator: binary(1000, generator),
            SHORT_OPS,
        ),
        "MulticlassConfusionMatrix(1000), 10,000 predictions": _Case(
            lambda: MulticlassConfusionMatrix(1000),
            lambda generator: multiclass(10_000, generator),
            LAUNCH_OPS,
        ),
        f"BinaryAUROC(thresholds=200), 1,000 predictions, an MLP's training step ({MODEL_LAYERS} layers)": _Case(
            lambda: BinaryAUROC(thresholds=200),
            lambda generator: binary(1000, generator),
            LAUNCH_OPS,
            MODEL_LAYERS,
        ),
        f"MulticlassConfusionMatrix(1000), 10,000 predictions, an MLP's training step ({MODEL_LAYERS} layers)": _Case(
            lambda: MulticlassConfusionMatrix(1000),
            lambda generator: multiclass(10_000, generator),
            LAUNCH_OPS,
            MODEL_LAYERS,
        ),
        "WordErrorRate, 32 sentences (Python)": _Case(torchmetrics.text.WordErrorRate, _text_batch(32), LAUNCH_OPS),
        "ROUGEScore (rouge1, rouge2, rougeL), 8 sentences (Python)": _Case(
            lambda: torchmetrics.text.ROUGEScore(rouge_keys=("rouge1", "rouge2", "rougeL")),
            _text_batch(8),
            LAUNCH_OPS,
        ),
    }
    try:
        import faster_coco_eval  # noqa: F401
        from torchmetrics.detection import MeanAveragePrecision

        metrics["MeanAveragePrecision (faster_coco_eval), 8 images"] = _Case(
            lambda: MeanAveragePrecision(backend="faster_coco_eval"),
            _detection_batch,
            LAUNCH_OPS,
        )
    except ImportError:
        pass
    return metrics


def _ops_step(x: Tensor, ops: int) -> None:
    """``ops`` small ops on ``x``, one after the other: a step that is mostly the dispatcher's Python and C++."""
    y = x
    for _ in range(ops // 3):
        y = y.mul(1.0001).add(0.0001).relu()


def _launch_bound_steps(
    metric: Metric | None, batches: list[tuple], steps: int, step: Callable[[], None], warm_up: int = 0
) -> tuple[float, float]:
    """The time per step of ``steps`` calls of ``step``, a Metric updated after each, then settled.

    Also the time per step spent in the ``update`` calls alone. ``warm_up`` steps run first, untimed, and their
    updates are waited for: what the last measure left (in the allocator, the caches) is not counted in this one.
    """
    if warm_up:
        _launch_bound_steps(metric, batches, warm_up, step)
    in_update = 0.0
    start = time.perf_counter()
    for index in range(steps):
        step()
        if metric is not None:
            called = time.perf_counter()
            metric.update(*batches[index % len(batches)])
            in_update += time.perf_counter() - called
    if metric is not None and _is_offloaded(metric):
        wait_for_updates(metric)  # the updates the worker still has are the steps' work; reading the states is not
    return (time.perf_counter() - start) / steps, in_update / steps


def launch(report: Report, rounds: int, steps: int) -> None:
    """Measure part 5 into ``report``: each Metric of :func:`_launch_metrics`.

    Each way (no Metric, inline, each worker) runs in a process of its own (the self-check's ``Way``), asked in
    turn, in a shuffled order each round. Measured side by side in one process, the step without a Metric took 5
    to 7% longer after an inline binned AUROC's updates, and 4% longer in a process with an idle worker thread: the
    offloaded ratios read lower than they are.
    """
    rng = random.Random(4)
    for index, (name, case) in enumerate(_launch_metrics().items()):
        with contextlib.ExitStack() as stack:
            serve = functools.partial(_serve_way, index)
            ways = {way: stack.enter_context(Way(way, serve)) for way in ("none", "inline", *WORKERS)}
            _launch_rounds(report, name, case.ops, ways, rounds, steps, rng)
            reads = sorted(ways["process"].ask(("read", steps)) for _ in range(READS))
            report.notes.append(
                f"launch-bound step, {name}: reading the states back from the worker process after {steps} updates"
                f" (once an epoch in a fit; left out of the steps above) took {statistics.median(reads):.1f} ms"
                f" (median of {READS}, {reads[0]:.1f} to {reads[-1]:.1f})"
            )
    if "MeanAveragePrecision (faster_coco_eval), 8 images" not in _launch_metrics():
        report.notes.append("launch-bound step: MeanAveragePrecision left out: `pip install faster-coco-eval` adds it")


def _launch_rounds(
    report: Report, name: str, ops: int, ways: dict[str, Way], rounds: int, steps: int, rng: random.Random
) -> None:
    short = ops < LAUNCH_OPS  # the update takes longer than the step: offloading must save most of it
    goal = {way: None if short or way == "inline" else GOAL_LAUNCH for way in ("inline", *WORKERS)}
    rows = {way: Row("5", f"launch-bound step, {name}: {way} vs no Metric", "ms", 1e3, goal[way]) for way in goal}
    against_inline = {
        worker: Row("5", f"launch-bound step, {name}: {worker} vs inline", "ms", 1e3, GOAL_SHORT)
        for worker in (WORKERS if short else ())
    }
    warm_up = min(WARM_UP_STEPS, steps)
    in_update: dict[str, list[float]] = {way: [] for way in goal}
    for _ in range(rounds):
        per_way = {}
        for way in shuffled(list(ways), rng):
            per_way[way], update_s = ways[way].ask(("measure", steps, warm_up))
            if way in in_update:
                in_update[way].append(update_s)
        for way, row in rows.items():
            row.base.append(per_way["none"])
            row.offloaded.append(per_way[way])
        for worker, row in against_inline.items():
            row.base.append(per_way["inline"])
            row.offloaded.append(per_way[worker])
        inline = ways["inline"].ask(("value",))
        for worker in WORKERS:
            report.check(f"{name}, {worker}", ways[worker].ask(("value",)), inline)
    report.rows += [*rows.values(), *against_inline.values()]
    report.notes.append(
        f"launch-bound step, {name}: the caller's time in `update`, per step (medians over the rounds): "
        + ", ".join(f"{way} {statistics.median(seconds) * 1e3:.3f} ms" for way, seconds in in_update.items())
    )
    if short:
        inline_row = rows["inline"]  # its baseline: the step without a Metric; its figures: the step with it inline
        floor = statistics.median((i - n) / i for i, n in zip(inline_row.offloaded, inline_row.base, strict=True))
        report.notes.append(
            f"launch-bound step, {name}: the update alone (the inline step less the step without a Metric) is"
            f" {floor:.3f} of the inline step: where the step waits for the worker, it takes about as long as the"
            " update does there, and its ratio against inline comes to about that"
        )


def _serve_way(index: int, way: str, threads: int, conn: Any) -> None:
    """The process of one way (a ``Way``): its step measured, its Metric's value, its states read back, as asked."""
    torch.set_num_threads(threads)
    warnings.filterwarnings("ignore", category=StoreOnCPUWarning)  # the short step falls behind on purpose
    _keep_freed_memory()
    case = list(_launch_metrics().values())[index]
    generator = torch.Generator().manual_seed(4)
    batches = [case.inputs(generator) for _ in range(8)]
    step = _Model(case.layers).step if case.layers else functools.partial(_ops_step, torch.ones(16), case.ops)
    metric = None if way == "none" else case.make() if way == "inline" else offload_to_cpu(case.make(), worker=way)
    _launch_bound_steps(metric, batches, 3, step)  # warm-up (a worker process starts)
    while (request := conn.recv()) is not None:
        try:
            kind, *args = request
            if kind == "measure":
                if metric is not None:
                    metric.reset()
                conn.send(_launch_bound_steps(metric, batches, args[0], step, warm_up=args[1]))
            elif kind == "value":
                conn.send(_flat_value(metric))
            else:  # "read": the states back from the worker process, after a measure's updates, from empty
                assert metric is not None
                metric.reset()
                _launch_bound_steps(metric, batches, args[0], step)
                start = time.perf_counter()
                settle(metric)
                conn.send((time.perf_counter() - start) * 1e3)
        except Exception as error:
            conn.send(error)


def _flat_value(metric: Metric | None) -> Tensor:
    """A Metric's value as one tensor (a dict of values, ROUGE's and mAP's, in key order)."""
    assert metric is not None
    value = metric.compute()
    if isinstance(value, dict):
        return torch.stack([value[key].float().reshape(-1)[0] for key in sorted(value)])
    return value
