"""Step time, device memory and host-device syncs of logging on a GPU: does ``store_on_cpu`` cost step time?

Five ways to log, in a real ``Trainer`` loop, with 1, 10 and 50 keys logged every step (``on_step`` and
``on_epoch``), on a small launch-bound model and a medium GPU-bound one:

  (a) no logging,  (b) ``self.log(name, value)`` kept on the device (plain Lightning),
  (c) ``self.log(name, value.cpu())`` (the naive offload),  (d) ``self.log(name, value, store_on_cpu=True)``,
  (e) (d) without the ordering of the copy: the training stream does not wait for the copy to the CPU, so a
      change of the value in place right after the call could reach the copy (``d / e`` is what the ordering costs).

Runs are interleaved round after round in a shuffled order; each figure is the median over rounds of the
measured epoch's time per step (the first epoch warms up). Then, for 10 keys on the small model: the bytes that
logging state holds on the device during training (from ``storage_report``), the host-device syncs per step made
inside the ``self.log`` calls (``torch.cuda.set_sync_debug_mode("warn")``), and how often a read of a stored value
had to wait for its copy to land. Prints markdown tables and writes them, with the date, the machine, the versions
and the command, to ``docs/performance/results/gpu_step_time.md`` (not with ``--quick`` or ``--no-docs``); with
``--out DIR``, also a PNG plot there.

Goals: (d) within 2% of (b) in step time, no sync added per step by lightning-store, no device memory held by
CPU-stored keys.

    python benchmarks/gpu_step_time.py [--rounds 3] [--steps 100] [--out DIR] [--no-docs]
    python benchmarks/gpu_step_time.py --device cpu --quick   # checks the script itself, without a GPU
"""

import argparse
import contextlib
import logging
import random
import statistics
import sys
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytorch_lightning as pl
import torch
from _tables import add_docs_option, publish
from pytorch_lightning.callbacks import Callback
from torch.utils.data import DataLoader

from lightning_store import StoreOnCPUMixin, _buffer, storage_report

VARIANTS = ("a: no logging", "b: on device", "c: value.cpu()", "d: store_on_cpu", "e: d, unordered")
MODELS = {"small": (32, 2, 64), "medium": (8192, 4, 1024)}  # width, depth, batch


class StepTimer(Callback):
    """Times the second epoch, with the device synchronised at its start and end only."""

    def __init__(self) -> None:
        self.step_s = float("nan")
        self.device_bytes = 0

    def on_train_epoch_start(self, trainer, pl_module):
        _synchronize(pl_module.device)
        self.start = time.perf_counter()

    def on_train_epoch_end(self, trainer, pl_module):
        _synchronize(pl_module.device)
        if trainer.current_epoch == 1:
            self.step_s = (time.perf_counter() - self.start) / trainer.num_training_batches
            rows = storage_report(trainer)
            self.device_bytes = sum(row.bytes for row in rows if not row.device.startswith("cpu"))


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def make_module(variant: str, model: str, keys: int, count_syncs: bool = False) -> pl.LightningModule:
    base = (StoreOnCPUMixin, pl.LightningModule) if variant[0] in "de" else (pl.LightningModule,)
    width, depth, batch = MODELS[model]

    class Bench(*base):
        def __init__(self) -> None:
            super().__init__()
            layers = [torch.nn.Linear(width, width) for _ in range(depth - 1)] + [torch.nn.Linear(width, 1)]
            self.net = torch.nn.Sequential(*[m for layer in layers for m in (layer, torch.nn.ReLU())][:-1])
            self.register_buffer("data", torch.randn(16, batch, width))
            self.names = [f"key_{k}" for k in range(keys)]
            self.syncs: list[int] = []

        def training_step(self, index, batch_idx):
            loss = self.net(self.data[index % 16]).pow(2).mean()
            if variant.startswith("a"):
                return loss
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                if count_syncs:
                    torch.cuda.set_sync_debug_mode("warn")
                try:
                    for name in self.names:
                        value = loss.detach()
                        if variant.startswith("b"):
                            self.log(name, value, on_step=True, on_epoch=True, batch_size=batch)
                        elif variant.startswith("c"):
                            self.log(name, value.cpu(), on_step=True, on_epoch=True, batch_size=batch)
                        else:
                            self.log(name, value, on_step=True, on_epoch=True, batch_size=batch, store_on_cpu=True)
                finally:
                    if count_syncs:
                        torch.cuda.set_sync_debug_mode("default")
            self.syncs.append(sum("synchroniz" in str(w.message) for w in caught))
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=1e-6)

    return Bench()


def fit(variant: str, model: str, keys: int, steps: int, device: str, count_syncs: bool = False):
    module = make_module(variant, model, keys, count_syncs)
    timer = StepTimer()
    trainer = pl.Trainer(
        accelerator=device,
        devices=1,
        max_epochs=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=[timer],
    )
    with unordered() if variant.startswith("e") else contextlib.nullcontext():
        trainer.fit(module, DataLoader(range(steps), batch_size=None))
    return timer, module


@contextlib.contextmanager
def unordered() -> Iterator[None]:
    """(e): the ordering of the copy before issue 18, the training stream not waiting for the copy to the CPU.

    The CPU buffer's ``start`` makes the copy stream wait for the training stream, then the training stream for the
    copy; inside it, here, only the copy stream waits for an event (benchmark instrumentation, undone after the fit).
    """
    start = _buffer._CUDATransfer.start
    wait_event = torch.cuda.Stream.wait_event

    def start_unordered(transfer, tensor, snapshot=False):
        def copy_stream_waits(stream, event):
            if stream == transfer._stream:
                wait_event(stream, event)

        torch.cuda.Stream.wait_event = copy_stream_waits
        try:
            return start(transfer, tensor, snapshot)
        finally:
            torch.cuda.Stream.wait_event = wait_event

    _buffer._CUDATransfer.start = start_unordered
    try:
        yield
    finally:
        _buffer._CUDATransfer.start = start


class WaitCounter:
    """Counts the reads of a stored value that had to wait for its copy to land (benchmark instrumentation)."""

    def __init__(self) -> None:
        self.waits = self.blocked = 0
        self._wait = _buffer._Slot.wait
        counter = self

        def wait(slot):
            counter.waits += 1
            counter.blocked += not slot.ready()
            return counter._wait(slot)

        _buffer._Slot.wait = wait

    def restore(self) -> None:
        _buffer._Slot.wait = self._wait


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--quick", action="store_true", help="1 round of 5 steps, small model, 1 and 10 keys")
    parser.add_argument("--out", type=Path, default=None, help="also write a PNG plot there")
    add_docs_option(parser)
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("No CUDA device: run this on a GPU, or pass --device cpu --quick to check the script itself.")
    warnings.filterwarnings("ignore")
    logging.getLogger("pytorch_lightning").setLevel(logging.ERROR)
    torch.backends.cuda.matmul.allow_tf32 = True
    models, key_counts = (["small"], [1, 10]) if args.quick else (list(MODELS), [1, 10, 50])
    rounds, steps = (1, 5) if args.quick else (args.rounds, args.steps)

    configs = [(m, v, k) for m in models for v in VARIANTS for k in (key_counts if v[0] != "a" else [0])]
    times: dict[tuple, list[float]] = {c: [] for c in configs}
    rng = random.Random(0)
    started = time.perf_counter()
    for _ in range(rounds):
        rng.shuffle(configs)
        for model, variant, keys in configs:
            timer, _ = fit(variant, model, keys, steps, args.device)
            times[(model, variant, keys)].append(timer.step_s)

    where = torch.cuda.get_device_name() if args.device == "cuda" else "the CPU (a check of the script only)"
    lines = [
        f"Step time on {where}: {rounds} round(s) of 2-epoch fits of {steps} steps, the ways in a shuffled order in"
        " each round; each figure is the median over rounds of the second epoch's time per step.",
        "",
        "| model | keys | (a) none ms | (b) on device ms | (c) .cpu() ms | (d) store_on_cpu ms | d / b | c / b |"
        " (e) d, unordered ms | d / e |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    plot: dict[str, dict[str, list[float]]] = {m: {v: [] for v in VARIANTS} for m in models}
    for model in models:
        none_ms = statistics.median(times[(model, VARIANTS[0], 0)]) * 1e3
        for keys in key_counts:
            b, c, d, e = (statistics.median(times[(model, v, keys)]) * 1e3 for v in VARIANTS[1:])
            lines.append(
                f"| {model} | {keys} | {none_ms:.3f} | {b:.3f} | {c:.3f} | {d:.3f} | {d / b:.3f} | {c / b:.3f} |"
                f" {e:.3f} | {d / e:.3f} |"
            )
            for variant, value in zip(VARIANTS, (none_ms, b, c, d, e), strict=True):
                plot[model][variant].append(value)

    lines += [
        "",
        "| 10 keys, small model | device bytes held by logging state | syncs per step in `self.log` |"
        " reads that waited for a copy, per step |",
        "| --- | --- | --- | --- |",
    ]
    for variant in VARIANTS[1:]:
        counter = WaitCounter()
        try:
            timer, module = fit(variant, "small", 10, max(steps, 10), args.device, args.device == "cuda")
        finally:
            counter.restore()
        syncs = statistics.mean(module.syncs[len(module.syncs) // 2 :])  # steady state, the second epoch
        waited = f"{counter.blocked / (2 * max(steps, 10)):.2f}" if variant[0] in "de" else "-"  # nothing to wait for
        lines.append(f"| {variant} | {timer.device_bytes} | {syncs:.2f} | {waited} |")
    notes = [f"the whole run took {time.perf_counter() - started:.0f} s"]
    publish("gpu_step_time", lines, notes, write=not (args.quick or args.no_docs or args.device != "cuda"))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        write_plot(plot, key_counts, args.out / "gpu_step_time.png", where)


def write_plot(plot, key_counts, path: Path, title: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot written")
        return
    figure, axes = plt.subplots(1, len(plot), figsize=(6 * len(plot), 4), squeeze=False)
    for ax, (model, series) in zip(axes[0], plot.items(), strict=True):
        for variant, values in series.items():
            ax.plot(key_counts, values, marker="o", label=variant)
        ax.set(title=f"{model} model", xlabel="keys logged per step", ylabel="step time (ms)", xscale="log")
        ax.set_xticks(key_counts, [str(k) for k in key_counts])
        ax.legend()
    figure.suptitle(title, fontsize=9)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    print(f"plot written to {path}")


if __name__ == "__main__":
    main()
