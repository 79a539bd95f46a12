"""The cost of ``store_states_on_cpu`` per ``update``, on the CPU, and (with a GPU) its step time, syncs and memory.

CPU: the time of ``update`` for ``BinaryAUROC(thresholds=None)`` kept as usual, with ``compute_on_cpu=True`` and
with ``store_states_on_cpu``, interleaved call by call in a shuffled order; medians per call and their ratios.

GPU (``--device cuda``): for the same three, the time per update (device synchronised only at the ends), the host
syncs per update made by ``update`` (``torch.cuda.set_sync_debug_mode("warn")``), the device bytes held by the
Metric's list states over the epoch (the peak, from the states themselves) and the device memory peak of a sync
(``gather_on_device`` in a 1-process NCCL group, chunked).

Sync (``--sync``): the wall time of syncing a list state kept one element per item (``dist_reduce_fx=None``, as
the per-sentence, per-image and per-query states of torchmetrics), of 100, 1,000 and 10,000 elements of 1 to 64
values each per process, configured vs plain, side by side in one run: 2 gloo processes on the CPU, or one NCCL
process per GPU with ``--device cuda``. torchmetrics gathers such a list element by element; the configured Metric
in a bounded number of collectives. The synced lists are checked equal, element by element.

Each prints its table and writes it, with the date, the machine, the versions and the command, to
``docs/performance/results/metric_states_{update,sync}_{cpu,cuda}.md`` (``--no-docs``: print only).

    python benchmarks/metric_states.py [--updates 2000] [--batch 256]
    python benchmarks/metric_states.py --device cuda [--updates 2000] [--batch 4096]
    python benchmarks/metric_states.py --sync [--device cuda]
"""

import argparse
import os
import random
import socket
import statistics
import tempfile
import time
import warnings

import torch
import torch.multiprocessing as mp
from _tables import add_docs_option, publish
from torch import Tensor
from torchmetrics import Metric
from torchmetrics.classification import BinaryAUROC

from lightning_store import gather_on_device, store_states_on_cpu

VARIANTS = ("on device", "compute_on_cpu=True", "store_states_on_cpu")


def make(variant: str, device: torch.device) -> BinaryAUROC:
    if variant == VARIANTS[1]:
        return BinaryAUROC(thresholds=None, compute_on_cpu=True).to(device)
    metric = BinaryAUROC(thresholds=None).to(device)
    return store_states_on_cpu(metric) if variant == VARIANTS[2] else metric


def cpu_per_update(updates: int, batch: int, write: bool) -> None:
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
    lines = [
        f"`BinaryAUROC(thresholds=None)` on the CPU, one torch thread: {updates:,} updates of {batch} predictions"
        " each, the three variants called in a shuffled order for every batch; the median time of `update`.",
        "",
        "| variant | per `update` | ratio to the plain Metric | ratio to `compute_on_cpu=True` |",
        "| --- | --- | --- | --- |",
    ]
    for v in VARIANTS:
        name = "plain Metric" if v == VARIANTS[0] else f"`{v}`"
        lines.append(
            f"| {name} | {medians[v]:.1f} µs | {medians[v] / medians[VARIANTS[0]]:.3f} |"
            f" {medians[v] / medians[VARIANTS[1]]:.3f} |"
        )
    publish("metric_states_update_cpu", lines, ["the values of the three variants are equal"], write=write)


def _list_state_device_bytes(metric: BinaryAUROC) -> int:
    return sum(t.numel() * t.element_size() for t in metric.preds + metric.target if not t.is_cpu)


def gpu(updates: int, batch: int, write: bool) -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    generator = torch.Generator(device=device).manual_seed(0)
    inputs = [
        (
            torch.rand(batch, device=device, generator=generator),
            torch.randint(0, 2, (batch,), device=device, generator=generator),
        )
        for _ in range(64)
    ]
    lines = [
        f"`BinaryAUROC(thresholds=None)` on the GPU: {updates:,} updates of {batch} predictions each; the time per"
        " update (the device synchronised at the ends only), the host syncs per update made by `update`, and the"
        " device bytes of its list states at their peak.",
        "",
        "| variant | per `update` | host syncs per update | device bytes of list states (peak) |",
        "| --- | --- | --- | --- |",
    ]
    notes = []
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
        name = "plain Metric" if variant == VARIANTS[0] else f"`{variant}`"
        lines.append(f"| {name} | {per_update:.1f} µs | {syncs:.2f} | {peak:,} |")
    with tempfile.NamedTemporaryFile() as store:
        torch.distributed.init_process_group("nccl", init_method=f"file://{store.name}", rank=0, world_size=1)
        states = torch.rand(updates * batch)  # the epoch's predictions, on the CPU
        for chunk_bytes in (2**20, 16 * 2**20, 64 * 2**20):
            torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device)
            gather_on_device(states, chunk_bytes=chunk_bytes)
            peak = torch.cuda.max_memory_allocated(device) - base
            notes.append(
                f"a sync of {states.numel() * 4:,} bytes with `chunk_bytes={chunk_bytes:,}`: a device memory peak of"
                f" {peak:,} bytes"
            )
        torch.distributed.destroy_process_group()
    publish("metric_states_update_cuda", lines, notes, write=write)


class PerItem(Metric):
    """A list state of one element per item, gathered by torchmetrics element by element."""

    full_state_update = False

    def __init__(self) -> None:
        super().__init__()
        self.add_state("items", default=[], dist_reduce_fx=None)

    def update(self, items: list[Tensor]) -> None:
        self.items.extend(items)

    def compute(self) -> Tensor:
        return torch.stack([item.sum() for item in self.items]).sum()


SYNC_COUNTS = (100, 1000, 10000)
SYNC_REPEATS = 3


def _timed_sync(metric: PerItem, device: torch.device) -> tuple[float, list[Tensor]]:
    torch.distributed.barrier()
    start = time.perf_counter()
    metric.sync()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    synced = [item.cpu() for item in metric.items]
    metric.unsync()
    return seconds, synced


def _sync_worker(rank: int, world: int, port: int, backend: str, results: "mp.Queue[str]") -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group(backend, rank=rank, world_size=world)
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    for count in SYNC_COUNTS:
        generator = torch.Generator().manual_seed(rank * 7 + count)
        lengths = torch.randint(1, 65, (count,), generator=generator).tolist()
        items = [torch.rand(n, generator=generator).to(device) for n in lengths]
        seconds: dict[str, list[float]] = {"configured": [], "plain": []}
        for _ in range(SYNC_REPEATS):
            for variant in random.Random(count).sample(sorted(seconds), 2):
                metric = store_states_on_cpu(PerItem()) if variant == "configured" else PerItem()
                metric.update(items)
                took, synced = _timed_sync(metric, device)
                seconds[variant].append(took)
                if variant == "plain":
                    expected = synced
                else:
                    got = synced
        assert len(got) == len(expected) and all(torch.equal(g, e) for g, e in zip(got, expected, strict=True))
        if rank == 0:
            configured, plain = (statistics.median(seconds[v]) for v in ("configured", "plain"))
            results.put(f"| {count:,} | {configured * 1e3:.1f} ms | {plain * 1e3:.1f} ms | {plain / configured:.1f} |")
    torch.distributed.destroy_process_group()


def sync_rows(device: str, write: bool) -> None:
    if device == "cuda":
        backend, world = "nccl", torch.cuda.device_count()
        where = f"{world} NCCL process(es), one per GPU ({torch.cuda.get_device_name(0)})"
    else:
        backend, world = "gloo", 2
        where = "2 gloo processes on the CPU"
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    context = mp.get_context("spawn")
    results = context.Queue()
    processes = [
        context.Process(target=_sync_worker, args=(rank, world, port, backend, results)) for rank in range(world)
    ]
    for process in processes:
        process.start()
    for process in processes:
        process.join(timeout=1800)
        assert process.exitcode == 0, f"a sync worker failed (exit code {process.exitcode})"
    lines = [
        f"The sync of a list state kept one element per item (`dist_reduce_fx=None`), {where}: each process holds"
        " that many elements of 1 to 64 float32 values; the configured and the plain Metric synced in turn, in a"
        f" shuffled order, {SYNC_REPEATS} times each; the median wall time. The synced lists are checked equal,"
        " element by element.",
        "",
        "| elements per process | configured | plain (torchmetrics, element by element) | plain / configured |",
        "| --- | --- | --- | --- |",
    ]
    lines += [results.get() for _ in SYNC_COUNTS]
    publish(f"metric_states_sync_{device}", lines, write=write)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--updates", type=int, default=2000)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--sync", action="store_true", help="time the sync of a list of one element per item")
    add_docs_option(parser)
    args = parser.parse_args()
    if args.sync:
        sync_rows(args.device, not args.no_docs)
    elif args.device == "cuda":
        gpu(args.updates, args.batch, not args.no_docs)
    else:
        cpu_per_update(args.updates, args.batch, not args.no_docs)


if __name__ == "__main__":
    main()
