"""Check 10, a measurement: whether offloading a Metric pays here beside a step that runs Python, by worker."""

import statistics
import time
from typing import Any, cast

import torch
from torchmetrics import Metric
from torchmetrics.classification import BinaryAUROC

from lightning_store import offload_to_cpu
from lightning_store._selfcheck._core import Context, Outcome
from lightning_store._selfcheck._fits import quiet
from lightning_store.metrics._offload.process.parent import _ProcessWorker  # no public API starts one alone
from lightning_store.metrics._reads import _queue_of  # the figures an offloaded Metric's own warning gives

OPS = 900  # small ops a step: a step mostly Python, as a host launching a GPU's kernels
PREDICTIONS = 1000
STEPS = 30
ROUNDS = 3
WAYS = ("none", "inline", "thread", "process")


def _steps(metric: Metric | None, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """The time per step of ``STEPS`` steps, the Metric updated in each, its worker waited for at the end.

    Not read back: a fit reads a Metric once an epoch, over many more steps than these (the read is timed apart).
    """
    x = torch.ones(16)
    start = time.perf_counter()
    for step in range(STEPS):
        y = x
        for _ in range(OPS // 3):
            y = y.mul(1.0001).add(0.0001).relu()
        if metric is not None:
            metric.update(*batches[step % len(batches)])
    queue = _queue_of(metric) if metric is not None else None
    if queue is not None:
        queue._wait()  # the updates the worker still has are the steps' work
    return (time.perf_counter() - start) / STEPS


def _read_s(metric: Metric, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """The seconds a read (``compute``) of an offloaded Metric takes, its worker caught up with ``STEPS`` steps."""
    _steps(metric, batches)
    start = time.perf_counter()
    metric.compute()
    return time.perf_counter() - start


def _worker_process_start() -> tuple[float, int | None]:
    """The seconds a worker process of its own takes to start (until it says so), and its resident bytes then."""
    worker = _ProcessWorker()
    started = time.perf_counter()
    worker.start()
    try:
        while not worker.ready and worker.conn is not None:
            worker.receive()
        seconds = time.perf_counter() - started
        return seconds, _resident_bytes(worker.process.pid) if worker.ready else None
    finally:
        worker.stop()


def _resident_bytes(pid: int) -> int | None:
    """A process's resident memory, from ``/proc`` (Linux); ``None`` where it cannot be read."""
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024  # in kB
    except (OSError, ValueError, IndexError):
        pass
    return None


def check_offload_pays(context: Context) -> Outcome:
    """The step with the Metric inline, offloaded to a thread and to a process, over the step without it."""
    generator = torch.Generator().manual_seed(0)
    batches = [
        (torch.rand(PREDICTIONS, generator=generator), torch.randint(0, 2, (PREDICTIONS,), generator=generator))
        for _ in range(4)
    ]
    metrics: dict[str, Metric | None] = {"none": None, "inline": BinaryAUROC(thresholds=200)}
    metrics |= {worker: offload_to_cpu(BinaryAUROC(thresholds=200), worker=worker) for worker in ("thread", "process")}
    times: dict[str, list[float]] = {way: [] for way in WAYS}
    # a worker that falls behind warns: the warning is part of what this check found, not a fault of a user's line
    with quiet() as warned:
        for metric in metrics.values():  # warm-up: the worker process starts
            _steps(metric, batches)
        for round_ in range(ROUNDS):
            for way in WAYS if round_ % 2 == 0 else reversed(WAYS):
                times[way].append(_steps(metrics[way], batches))
    read_s = _read_s(cast(Metric, metrics["process"]), batches)
    start_s, resident = _worker_process_start()
    # per update, as the Metric measures it to warn that offloading does not pay: hand-off, work moved, Python held
    payoffs = {}
    for worker in ("thread", "process"):
        queue = _queue_of(cast(Metric, metrics[worker]))
        payoffs[worker] = queue.payoff.last if queue is not None else None
    step = statistics.median(times["none"])
    ratios = {way: statistics.median(times[way]) / step for way in WAYS[1:]}
    best = min(ratios, key=ratios.__getitem__)
    verdict = (
        "here, offloading does not pay for such a step: keep the Metric inline"
        if best == "inline"
        else f"here, worker={best!r} pays most for such a step"
    )
    detail = (
        f"a step of {OPS} small ops (mostly Python, as a host launching a GPU's kernels) with BinaryAUROC"
        f"(thresholds=200) of {PREDICTIONS} predictions updated in it, with {torch.get_num_threads()} torch"
        f" thread(s), over the step without ({step * 1e3:.2f} ms):"
        f" inline {ratios['inline']:.2f}, worker thread {ratios['thread']:.2f}, worker process"
        f" {ratios['process']:.2f}; {verdict}; per update, {_payoff_figures(payoffs)};"
        f" reading the states back from the worker process (once an epoch in a fit) took {read_s * 1e3:.1f} ms;"
        f" a worker process started in {start_s:.1f} s and held"
        + (f" {resident / 2**20:.0f} MiB then" if resident is not None else " memory this system does not show")
        + "".join(f"; lightning-store warned: {message.split('. ')[0]}" for message in warned)
        + f" (medians of {ROUNDS} rounds of {STEPS} steps)"
    )
    data: dict[str, Any] = {
        "ratios": ratios,
        "step_s": times,
        "ops": OPS,
        "torch_threads": torch.get_num_threads(),
        "steps": STEPS,
        "best": best,
        "per_update_s": payoffs,
        "worker_start_s": start_s,
        "process_read_s": read_s,
        "worker_resident_bytes": resident,
        "warnings": warned,
    }
    return Outcome("INFO", detail, data)


def _payoff_figures(payoffs: dict[str, tuple[float, float, float] | None]) -> str:
    """What each worker's hand-off cost the step per update, against the update's work it moved off the step.

    The Metric's own measure, by which it warns when offloading cannot pay; the ratios above say whether it pays.
    """
    said = []
    for worker, figures in payoffs.items():
        if figures is None:
            said.append(f"worker {worker}: not measured (too few updates)")
            continue
        handoff, saved, held = figures
        held_part = f" and {held * 1e3:.3f} ms of Python held" if worker == "thread" else ""
        said.append(
            f"worker {worker}: a hand-off of {handoff * 1e3:.3f} ms{held_part} against {saved * 1e3:.3f} ms of work"
            f" moved ({'no warning' if handoff + held < saved else 'it warns: costs more than it saves'})"
        )
    return ", ".join(said)
