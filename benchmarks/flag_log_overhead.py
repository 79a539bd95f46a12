"""The cost of ``self.log`` in a module without the mixin under ``lightning_store.Trainer``, with and without the flag.

Each fit runs one module and one Trainer and times every ``self.log`` call of its steps; the figure of a fit is the
median over its calls. Four ways, one fit each, in an order shuffled in every round; each round gives a ratio to
the first, and the script prints the median ratio over rounds with its interquartile range (the machine's noise):

- a plain module under ``pytorch_lightning.Trainer``: the baseline;
- the same under ``lightning_store.Trainer(move_metrics_to_cpu=False)``: nothing is installed, so it pays nothing;
- the same under ``lightning_store.Trainer(move_metrics_to_cpu=True)``: every key stored on the CPU;
- a ``StoreOnCPUMixin`` module logging with ``store_on_cpu=True`` under ``pytorch_lightning.Trainer``: what the
  flag must cost no more than.

Goals: at most 1.02 per call without the flag, at most 1.05 with it. Prints the table and writes it, with the
date, the machine, the versions and the command, to ``docs/performance/results/flag_log_overhead.md``
(``--no-docs``: print only).

    python benchmarks/flag_log_overhead.py [--rounds 15] [--steps 300] [--keys 10] [--no-docs]
"""

import argparse
import logging
import random
import statistics
import time
import warnings
from typing import ClassVar

import pytorch_lightning as pl
import torch
from _tables import add_docs_option, publish
from cpu_log_overhead import quartiles
from torch.utils.data import DataLoader, TensorDataset

import lightning_store

LOG_KWARGS = {"on_step": True, "on_epoch": True, "batch_size": 16}
BASELINE = "plain module, pytorch_lightning.Trainer"
GOALS = {
    "plain module, lightning_store.Trainer(move_metrics_to_cpu=False)": 1.02,
    "plain module, lightning_store.Trainer(move_metrics_to_cpu=True)": 1.05,
}
REFERENCE = "mixin module, store_on_cpu=True, pytorch_lightning.Trainer"
WAYS = (BASELINE, *GOALS, REFERENCE)
NAMES = {  # as the docs' table shows them
    BASELINE: "plain module, `pytorch_lightning.Trainer`",
    WAYS[1]: "plain module, `lightning_store.Trainer`, flag off",
    WAYS[2]: "plain module, `lightning_store.Trainer(move_metrics_to_cpu=True)`",
    REFERENCE: "mixin module, `store_on_cpu=True`, `pytorch_lightning.Trainer`",
}


class _Plain(pl.LightningModule):
    store: ClassVar[dict[str, bool]] = {}  # what `self.log` gets besides LOG_KWARGS

    def __init__(self, keys: int) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(8, 1)
        self.keys = keys
        self.call_ns: list[int] = []

    def training_step(self, batch, batch_idx):
        loss = self.layer(batch[0]).pow(2).mean()
        value = loss.detach()
        for key in range(self.keys):
            start = time.perf_counter_ns()
            self.log(f"key_{key}", value, **LOG_KWARGS, **self.store)
            self.call_ns.append(time.perf_counter_ns() - start)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


class _Mixin(lightning_store.StoreOnCPUMixin, _Plain):
    store: ClassVar[dict[str, bool]] = {"store_on_cpu": True}


def fit(way: str, keys: int, steps: int) -> float:
    """The median time of a ``self.log`` call, in ns, over a fit of ``steps`` steps logging ``keys`` keys."""
    module = (_Mixin if way == REFERENCE else _Plain)(keys)
    kwargs = {
        "max_epochs": 1,
        "accelerator": "cpu",
        "devices": 1,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "log_every_n_steps": 50,
    }
    if "lightning_store.Trainer" in way:
        trainer = lightning_store.Trainer(**kwargs, move_metrics_to_cpu=way.endswith("=True)"))
    else:
        trainer = pl.Trainer(**kwargs)
    trainer.fit(module, DataLoader(TensorDataset(torch.randn(16 * steps, 8)), batch_size=16))
    return statistics.median(module.call_ns)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--keys", type=int, default=10)
    add_docs_option(parser)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    logging.getLogger("pytorch_lightning").setLevel(logging.ERROR)
    logging.getLogger("lightning_fabric").setLevel(logging.ERROR)
    torch.set_num_threads(1)

    rng = random.Random(0)
    per_call: dict[str, list[float]] = {way: [] for way in WAYS}
    for way in WAYS:
        fit(way, args.keys, args.steps // 10)  # warm-up
    for _ in range(args.rounds):
        order = list(WAYS)
        rng.shuffle(order)
        for way in order:
            per_call[way].append(fit(way, args.keys, args.steps))

    lines = [
        f"{args.keys} keys logged `on_step` and `on_epoch` (mean) every step, one torch thread. Each way runs in"
        f" fits of its own, one {args.steps}-step fit per way in a shuffled order in each of {args.rounds} rounds; a"
        f" fit's time per call is the median of its {args.keys * args.steps:,} calls. The ratio is the median over"
        " rounds of the per-round ratios to the first row, with its interquartile range.",
        "",
        "| module, Trainer | per call (median over rounds) | ratio, median (IQR) |",
        "| --- | --- | --- |",
    ]
    goals = []
    for way in WAYS:
        ratios = [ns / base for ns, base in zip(per_call[way], per_call[BASELINE], strict=True)]
        q1, ratio, q3 = quartiles(ratios)
        lines.append(
            f"| {NAMES[way]} | {statistics.median(per_call[way]) / 1000:.1f} µs | {ratio:.3f} ({q1:.3f} to {q3:.3f}) |"
        )
        if way in GOALS:
            met = "met" if ratio <= GOALS[way] else "not met"
            goals.append(f"{NAMES[way]}: {ratio:.3f}, goal at most {GOALS[way]}: {met}")
    flag = statistics.median(per_call[WAYS[2]]) / statistics.median(per_call[REFERENCE])
    notes = [f"the flag against the mixin's `store_on_cpu=True`: {flag:.3f}"]
    publish("flag_log_overhead", lines, notes, goals=goals, write=not args.no_docs)


if __name__ == "__main__":
    main()
