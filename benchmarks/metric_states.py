"""The cost of ``store_states_on_cpu`` per ``update``, on the CPU, and (with a GPU) its step time, syncs and memory.

CPU: the time of ``update`` for ``BinaryAUROC(thresholds=None)`` kept as usual, with ``compute_on_cpu=True`` and
with ``store_states_on_cpu``, interleaved call by call in a shuffled order; medians per call and their ratios.

GPU (``--device cuda``): for the same three, the time per update (device synchronised only at the ends), the host
syncs per update made by ``update`` (``torch.cuda.set_sync_debug_mode("warn")``), the device bytes held by the
Metric's list states over the epoch (the peak, from the states themselves) and the device memory peak of a sync
(``gather_on_device`` in a 1-process NCCL group, chunked).

    python benchmarks/metric_states.py [--updates 2000] [--batch 256]
    python benchmarks/metric_states.py --device cuda [--updates 2000] [--batch 4096]
"""

import argparse
import random
import statistics
import tempfile
import time
import warnings

import torch
from torchmetrics.classification import BinaryAUROC

from lightning_store import gather_on_device, store_states_on_cpu

VARIANTS = ("on device", "compute_on_cpu=True", "store_states_on_cpu")


def make(variant: str, device: torch.device) -> BinaryAUROC:
    if variant == VARIANTS[1]:
        return BinaryAUROC(thresholds=None, compute_on_cpu=True).to(device)
    metric = BinaryAUROC(thresholds=None).to(device)
    return store_states_on_cpu(metric) if variant == VARIANTS[2] else metric


def cpu_per_update(updates: int, batch: int) -> None:
    torch.set_num_threads(1)
    device = torch.device("cpu")
    metrics = {v: make(v, device) for v in VARIANTS}
    times: dict[str, list[int]] = {v: [] for v in VARIANTS}
    generator = torch.Generator().manual_seed(0)
    order = list(VARIANTS)
    for _ in range(updates):
        preds, target = torch.rand(batch, generator=generator), torch.randint(0, 2, (batch,), generator=generator)
        random.shuffle(order)
        for variant in order:
            start = time.perf_counter_ns()
            metrics[variant].update(preds, target)
            times[variant].append(time.perf_counter_ns() - start)
    values = {v: m.compute() for v, m in metrics.items()}
    assert all(torch.equal(values[VARIANTS[0]], value) for value in values.values())
    medians = {v: statistics.median(t) / 1000 for v, t in times.items()}
    print(f"CPU, torch {torch.__version__}, one thread, {updates} updates of {batch} predictions each\n")
    print("| variant | per `update` | ratio to on device | ratio to compute_on_cpu=True |")
    print("| --- | --- | --- | --- |")
    for v in VARIANTS:
        print(
            f"| {v} | {medians[v]:.1f} µs | {medians[v] / medians[VARIANTS[0]]:.3f} | "
            f"{medians[v] / medians[VARIANTS[1]]:.3f} |"
        )


def _list_state_device_bytes(metric: BinaryAUROC) -> int:
    return sum(t.numel() * t.element_size() for t in metric.preds + metric.target if not t.is_cpu)


def gpu(updates: int, batch: int) -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    generator = torch.Generator(device=device).manual_seed(0)
    inputs = [
        (
            torch.rand(batch, device=device, generator=generator),
            torch.randint(0, 2, (batch,), device=device, generator=generator),
        )
        for _ in range(64)
    ]
    print(f"GPU {torch.cuda.get_device_name(device)}, torch {torch.__version__}, {updates} updates of {batch}\n")
    print("| variant | per `update` | syncs per update | device bytes of list states (peak) |")
    print("| --- | --- | --- | --- |")
    for variant in VARIANTS:
        metric = make(variant, device)
        metric.update(*inputs[0])  # warm up: pinned pool, kernels
        metric.reset()
        peak = 0
        torch.cuda.synchronize(device)
        start = time.perf_counter()
        for i in range(updates):
            metric.update(*inputs[i % len(inputs)])
            if i % 100 == 0:
                peak = max(peak, _list_state_device_bytes(metric))
        torch.cuda.synchronize(device)
        per_update = (time.perf_counter() - start) / updates * 1e6
        peak = max(peak, _list_state_device_bytes(metric))
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            for i in range(20):
                metric.update(*inputs[i])
            torch.cuda.set_sync_debug_mode("default")
        syncs = sum("synchroniz" in str(w.message) for w in record) / 20
        metric.compute()
        print(f"| {variant} | {per_update:.1f} µs | {syncs:.2f} | {peak} |")
    with tempfile.NamedTemporaryFile() as store:
        torch.distributed.init_process_group("nccl", init_method=f"file://{store.name}", rank=0, world_size=1)
        states = torch.rand(updates * batch)  # the epoch's predictions, on the CPU
        for chunk_bytes in (2**20, 16 * 2**20, 64 * 2**20):
            torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device)
            gather_on_device(states, chunk_bytes=chunk_bytes)
            peak = torch.cuda.max_memory_allocated(device) - base
            print(f"\nsync of {states.numel() * 4} bytes with chunk_bytes={chunk_bytes}: device peak {peak} bytes")
        torch.distributed.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--updates", type=int, default=2000)
    parser.add_argument("--batch", type=int, default=256)
    args = parser.parse_args()
    if args.device == "cuda":
        gpu(args.updates, args.batch)
    else:
        cpu_per_update(args.updates, args.batch)


if __name__ == "__main__":
    main()
