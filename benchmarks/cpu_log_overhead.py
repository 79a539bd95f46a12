"""The cost of ``self.log`` through ``StoreOnCPUMixin`` against plain ``LightningModule.log``, on the CPU.

Per call: one module logs the same value under three sets of keys in every step of a real ``Trainer`` loop, through
``LightningModule.log`` itself, through the mixin with ``store_on_cpu=False`` and through the mixin with
``store_on_cpu=True``, in an order that rotates from step to step, timing each call. The three are measured side by
side, in the same steps, so the machine's noise falls on all alike.

Per fit: the CPU time of the process over a whole short ``Trainer.fit`` (one thread; CPU time, not wall time, so
that other load on a shared machine counts less) of a module that logs its keys one way (plain Lightning,
the mixin with ``store_on_cpu=False``, the mixin with ``store_on_cpu=True``). The three fits run in a shuffled order
in each round; each round gives a ratio to plain Lightning, and the script prints the median ratio over rounds
with its interquartile range.

The plain calls of the per-call measurement run in the same Trainer as the mixin's, whose result collections the
mixin has set up: they pass its policy check too. The per-fit measurement, and ``flag_log_overhead.py``, run each
way in a Trainer of its own.

Goals: at most 1.05 per call and 1.02 per fit. Prints the table and writes it, with the date, the machine, the
versions and the command, to ``docs/performance/results/cpu_log_overhead.md`` (``--no-docs``: print only).

    python benchmarks/cpu_log_overhead.py [--rounds 25] [--steps 300] [--keys 10] [--no-docs]
"""

import argparse
import logging
import random
import statistics
import time
import warnings

import pytorch_lightning as pl
import torch
from _tables import add_docs_option, publish
from torch.utils.data import DataLoader, TensorDataset

from lightning_store import StoreOnCPUMixin

GOALS = {"per call": 1.05, "per fit": 1.02}
VARIANTS = ("lightning", "mixin, store_on_cpu=False", "mixin, store_on_cpu=True")
LOG_KWARGS = {"on_step": True, "on_epoch": True, "batch_size": 16}


class _Module(StoreOnCPUMixin, pl.LightningModule):
    def __init__(self, keys: int, variants: tuple[str, ...]) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(8, 1)
        self.keys, self.variants = keys, variants
        self.call_ns: dict[str, list[int]] = {v: [] for v in variants}

    def _log(self, variant: str, name: str, value: torch.Tensor) -> None:
        if variant == VARIANTS[0]:
            pl.LightningModule.log(self, name, value, **LOG_KWARGS)
        else:
            self.log(name, value, store_on_cpu=variant == VARIANTS[2], **LOG_KWARGS)

    def training_step(self, batch, batch_idx):
        loss = self.layer(batch[0]).pow(2).mean()
        value = loss.detach()
        shift = batch_idx % len(self.variants)
        order = self.variants[shift:] + self.variants[:shift]
        for key in range(self.keys):
            for variant in order:
                start = time.perf_counter_ns()
                self._log(variant, f"{VARIANTS.index(variant)}_{key}", value)
                self.call_ns[variant].append(time.perf_counter_ns() - start)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def fit(module: _Module, steps: int) -> float:
    data = DataLoader(TensorDataset(torch.randn(16 * steps, 8)), batch_size=16)
    trainer = pl.Trainer(
        max_epochs=1,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        log_every_n_steps=50,
    )
    start = time.process_time()
    trainer.fit(module, data)
    return time.process_time() - start


def quartiles(values: list[float]) -> tuple[float, float, float]:
    q1, median, q3 = statistics.quantiles(values, n=4)
    return q1, median, q3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=25)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--keys", type=int, default=10)
    add_docs_option(parser)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    logging.getLogger("pytorch_lightning").setLevel(logging.ERROR)
    torch.set_num_threads(1)

    # per call: all three in the same fits, call by call
    side_by_side = _Module(args.keys, VARIANTS)
    fit(side_by_side, args.steps // 10)  # warm-up
    side_by_side.call_ns = {v: [] for v in VARIANTS}
    for _ in range(max(1, args.rounds // 5)):
        fit(side_by_side, args.steps)
    per_call = {v: statistics.median(ns) for v, ns in side_by_side.call_ns.items()}

    # per fit: one variant per fit, shuffled within each round, ratios paired by round
    rng = random.Random(0)
    fit_s: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for variant in VARIANTS:
        fit(_Module(args.keys, (variant,)), args.steps // 10)  # warm-up
    for _ in range(args.rounds):
        order = list(VARIANTS)
        rng.shuffle(order)
        for variant in order:
            fit_s[variant].append(fit(_Module(args.keys, (variant,)), args.steps))

    calls = len(side_by_side.call_ns[VARIANTS[0]])
    lines = [
        f"{args.keys} keys logged `on_step` and `on_epoch` (mean) every step, one torch thread. Per call: the three"
        f" ways in the same steps of the same fits, the median of {calls:,} calls each (the ratio is to the first"
        f" row). Per fit: the CPU time of whole {args.steps}-step fits, one way per fit, in a shuffled order in each"
        f" of {args.rounds} rounds; the median of the per-round ratios to the first row, with its interquartile range.",
        "",
        "| variant | per call | ratio | per fit (CPU time) | ratio, median (IQR) |",
        "| --- | --- | --- | --- | --- |",
    ]
    goals = []
    for variant in VARIANTS:
        call_ratio = per_call[variant] / per_call[VARIANTS[0]]
        ratios = [v / base for v, base in zip(fit_s[variant], fit_s[VARIANTS[0]], strict=True)]
        q1, fit_ratio, q3 = quartiles(ratios)
        name = "`LightningModule.log`" if variant == VARIANTS[0] else f"mixin, `{variant.partition(', ')[2]}`"
        lines.append(
            f"| {name} | {per_call[variant] / 1000:.1f} µs | {call_ratio:.3f} |"
            f" {statistics.median(fit_s[variant]):.3f} s | {fit_ratio:.3f} ({q1:.3f} to {q3:.3f}) |"
        )
        if variant != VARIANTS[0]:
            for what, ratio in (("per call", call_ratio), ("per fit", fit_ratio)):
                met = "met" if ratio <= GOALS[what] else "not met"
                goals.append(f"{name}, {what}: {ratio:.3f}, goal at most {GOALS[what]}: {met}")
    publish("cpu_log_overhead", lines, goals=goals, write=not args.no_docs)


if __name__ == "__main__":
    main()
