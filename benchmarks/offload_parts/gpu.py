"""Part 6 of ``benchmarks/offload.py``, on CUDA: host syncs, device bytes and a launch-bound step, offloaded."""

import random
import threading
import time
import warnings

import torch
from torchmetrics import Metric
from torchmetrics.classification import BinaryAUROC

from lightning_store import offload_to_cpu
from lightning_store.metrics._reads import _is_offloaded
from offload_parts.report import WORKERS, Report, Row, settle, shuffled

GOAL_STEP = 1.02


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
    for value in metric.metric_state.values():
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
        settle(metric)
        with SyncCounter() as steady:
            for i in range(GPU_SYNC_UPDATES):
                metric.update(*batches[i % len(batches)])
        settle(metric)  # a read waits for the copies: a sync, which `update` must not make
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
        if metric is not None and _is_offloaded(metric):
            settle(metric)  # outside the timed region
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
        per_way = {way: timed(ways[way]) for way in shuffled(list(ways), rng)}
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
