"""Check 10, a measurement: whether offloading a Metric pays here beside a step that runs Python, by worker."""

import contextlib
import statistics
import time
from typing import Any, cast

import torch
from torchmetrics import Metric
from torchmetrics.classification import BinaryAUROC

from lightning_store import offload_to_cpu
from lightning_store._selfcheck._core import Context, Outcome
from lightning_store._selfcheck._fits import quiet
from lightning_store._selfcheck._way import Way
from lightning_store.metrics._offload.process.child import _keep_freed_memory
from lightning_store.metrics._offload.process.parent import _ProcessWorker  # no public API starts one alone
from lightning_store.metrics._reads import _queue_of  # the figures an offloaded Metric's own warning gives
from lightning_store.metrics.offload import _Worker

OPS = 900  # small ops a step: a step mostly Python, as a host launching a GPU's kernels
PREDICTIONS = 1000
STEPS = 30
ROUNDS = 7
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


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    return [
        (torch.rand(PREDICTIONS, generator=generator), torch.randint(0, 2, (PREDICTIONS,), generator=generator))
        for _ in range(4)
    ]


def _serve(way: str, threads: int, conn: Any) -> None:
    """A way's process (``_way.Way``): ``"steps"``, ``"payoff"`` and ``"read"`` answered, until ``None``.

    Its last answer is the messages of lightning-store's warnings given there: a worker that falls behind warns,
    which is part of what the check found, not a fault of a user's line.
    """
    torch.set_num_threads(threads)
    _keep_freed_memory()  # as in a training process, which has freed large blocks before (its model's, say)
    try:
        with quiet() as warned:
            batches = _batches()
            metric: Metric | None = None if way == "none" else BinaryAUROC(thresholds=200)
            if metric is not None and way != "inline":
                metric = offload_to_cpu(metric, worker=cast(_Worker, way))
            _steps(metric, batches)  # warm-up: a worker process starts
            while (request := conn.recv()) is not None:
                if request == "steps":
                    conn.send(_steps(metric, batches))
                elif request == "payoff":  # per update, as the Metric measures it to warn that it does not pay
                    queue = _queue_of(cast(Metric, metric))
                    conn.send(queue.payoff.last if queue is not None else None)
                else:
                    conn.send(_read_s(cast(Metric, metric), batches))
        conn.send(warned)
    except Exception as error:  # sent as it can be pickled: the parent raises it
        conn.send(RuntimeError(f"{type(error).__name__}: {error}"))


def check_offload_pays(context: Context) -> Outcome:
    """The step with the Metric inline, offloaded to a thread and to a process, over the step without it.

    Each way runs in a process of its own (``_way.py``), asked in turn, the order reversed every other round.
    """
    times: dict[str, list[float]] = {way: [] for way in WAYS}
    with contextlib.ExitStack() as stack:
        ways = {way: stack.enter_context(Way(way, _serve)) for way in WAYS}
        for round_ in range(ROUNDS):
            for way in WAYS if round_ % 2 == 0 else reversed(WAYS):
                times[way].append(ways[way].ask("steps"))
        payoffs = {worker: ways[worker].ask("payoff") for worker in ("thread", "process")}
        read_s = ways["process"].ask("read")
        warned = list(dict.fromkeys(message for way in ways.values() for message in way.close()))
    start_s, resident = _worker_process_start()
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
