"""Checks 1 and 2: plain ``self.log`` against ``store_on_cpu=True`` in real fits: same values, state on the CPU."""

from dataclasses import asdict, dataclass, field
from typing import Any

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import Callback

from lightning_store import KeyStorage, StoreOnCPUMixin, format_storage_report, storage_report
from lightning_store._selfcheck._compare import RTOL, Comparison, as_float, compare
from lightning_store._selfcheck._core import Context, Outcome
from lightning_store._selfcheck._fits import MemoryLogger, batches, make_trainer, quiet
from lightning_store._selfcheck._render import INDENT, terminal_width

FROM_CPU = "_from_cpu"  # suffix of the keys that log a CPU copy of a device value


class ValuesModel(StoreOnCPUMixin, pl.LightningModule):
    """Logs the same values as plain Lightning or stored on the CPU: every reduction, step and epoch, a number.

    Args:
        store_on_cpu: passed to every ``self.log`` call.
        sync_dist: passed to every ``self.log`` call.
        from_cpu: also log a CPU copy of ``x_mean`` (only with ``store_on_cpu``: Lightning alone hands a CPU
            tensor to NCCL, which refuses it).
    """

    def __init__(self, store_on_cpu: bool, sync_dist: bool = False, from_cpu: bool = False) -> None:
        super().__init__()
        self.net = torch.nn.Linear(4, 1)
        self.store, self.sync, self.from_cpu = store_on_cpu, sync_dist, from_cpu
        self.backend = ""

    def _log(self, name: str, value: Any, **kwargs: Any) -> None:
        self.log(name, value, store_on_cpu=self.store, sync_dist=self.sync, **kwargs)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self._log("loss", loss, prog_bar=True, on_step=True, on_epoch=True)
        x_mean = x[:, 0].mean() + batch_idx
        self._log("x_mean", x_mean, on_step=True, on_epoch=True, batch_size=len(x))
        if self.from_cpu:
            self._log(f"x_mean{FROM_CPU}", x_mean.cpu(), on_step=True, on_epoch=True, batch_size=len(x))
        self._log("x_sum", x[:, 1].sum(), reduce_fx="sum", on_step=False, on_epoch=True)
        self._log("x_max", x[:, 2].max(), reduce_fx="max", on_step=True, on_epoch=True)
        self._log("x_min", x[:, 3].min(), reduce_fx="min", on_step=True, on_epoch=False)
        self._log("step_number", float(batch_idx), reduce_fx="sum", on_step=False, on_epoch=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self._log("val_loss", torch.nn.functional.mse_loss(self.net(x), y))
        self._log("val_x_max", x[:, 0].max(), reduce_fx="max")

    def on_train_start(self) -> None:
        distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
        self.backend = str(torch.distributed.get_backend()) if distributed else ""

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


@dataclass(eq=False)
class StorageProbe(Callback):
    """Takes the storage report after every training and validation step, and keeps what it saw."""

    reports: int = 0
    cpu_keys: set[str] = field(default_factory=set)  # keys stored on the CPU by the option
    plain_keys: set[str] = field(default_factory=set)  # tensor keys stored as usual
    off_cpu: set[str] = field(default_factory=set)  # CPU-stored keys seen with a tensor elsewhere
    accelerator_bytes: int = 0  # the most that CPU-stored keys held off the CPU in one report
    plain_accelerator_bytes: int = 0  # the same, for the keys stored as usual
    last: list[KeyStorage] = field(default_factory=list)

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self._probe(trainer)

    def on_validation_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self._probe(trainer)

    def _probe(self, trainer: pl.Trainer) -> None:
        rows = storage_report(trainer)
        self.reports += 1
        self.last = rows
        held = {True: 0, False: 0}
        for row in rows:
            if row.kind != "tensor":
                continue
            (self.cpu_keys if row.store_on_cpu else self.plain_keys).add(f"{row.loop}/{row.name}")
            if row.device not in ("cpu", "-"):
                held[row.store_on_cpu] += row.bytes
                if row.store_on_cpu:
                    self.off_cpu.add(f"{row.loop}/{row.name} on {row.device}")
        self.accelerator_bytes = max(self.accelerator_bytes, held[True])
        self.plain_accelerator_bytes = max(self.plain_accelerator_bytes, held[False])


@dataclass
class FitRecord:
    """What one fit logged, as floats by key, with its storage probe and the model's process-group backend."""

    values: dict[str, float]
    probe: StorageProbe
    backend: str
    warnings: list[str]


def fit_and_record(context: Context, model: ValuesModel, ddp: bool = False) -> FitRecord:
    """Fit ``model`` for 2 epochs of 12 steps (3 validation steps each) and record every value logged."""
    probe, logger = StorageProbe(), MemoryLogger()
    with quiet() as ours:
        trainer = make_trainer(context, ddp=ddp, logger=logger, log_every_n_steps=1, callbacks=[probe])
        trainer.fit(model, batches(12), batches(3, seed=1))
    values = {f"step {step}: {key}": value for step, metrics in logger.history for key, value in metrics.items()}
    values.update({f"callback_metrics: {key}": as_float(value) for key, value in trainer.callback_metrics.items()})
    return FitRecord(values, probe, model.backend, ours)


def value_fits(context: Context) -> tuple[FitRecord, FitRecord]:
    """The plain fit and the ``store_on_cpu=True`` fit on the context's device, run once for checks 1 and 2."""

    def run() -> tuple[FitRecord, FitRecord]:
        records = []
        for store in (False, True):
            torch.manual_seed(0)
            records.append(fit_and_record(context, ValuesModel(store_on_cpu=store)))
        return records[0], records[1]

    fits: tuple[FitRecord, FitRecord] = context.once("value_fits", run)
    return fits


def compare_runs(plain: FitRecord, stored: FitRecord, accelerator: str) -> tuple[Comparison, Comparison | None]:
    """The stored run against the plain one; its ``*_from_cpu`` keys, if any, against the plain device keys."""
    own = {key: value for key, value in stored.values.items() if FROM_CPU not in key}
    twins = {key.replace(FROM_CPU, ""): value for key, value in stored.values.items() if FROM_CPU in key}
    rtol = 0.0 if accelerator == "cpu" else RTOL
    from_cpu = compare({k: plain.values[k] for k in twins if k in plain.values}, twins, rtol) if twins else None
    return compare(plain.values, own, rtol), from_cpu


def check_values(context: Context) -> Outcome:
    """Check 1: ``store_on_cpu=True`` logs the same values as plain ``self.log`` (every step, and the epoch)."""
    plain, stored = value_fits(context)
    comparison, _ = compare_runs(plain, stored, context.accelerator)
    passed = comparison.passed(0.0 if context.accelerator == "cpu" else RTOL)
    detail = f"{comparison.describe()} (loggers' step values and callback_metrics of 2-epoch fits)"
    return Outcome("PASS" if passed else "FAIL", detail, {**comparison.as_data(), "warnings": stored.warnings})


def check_storage(context: Context) -> Outcome:
    """Check 2: while the fit runs, every tensor of a CPU-stored key is on the CPU; 0 bytes on the accelerator."""
    plain, stored = value_fits(context)
    probe = stored.probe
    problems = []
    if not probe.cpu_keys:
        problems.append("no key was stored on the CPU")
    if probe.plain_keys:
        problems.append(f"keys logged with store_on_cpu=True but stored as usual: {sorted(probe.plain_keys)}")
    if probe.off_cpu:
        problems.append(f"CPU-stored keys seen off the CPU: {sorted(probe.off_cpu)}")
    if probe.accelerator_bytes:
        problems.append(f"{probe.accelerator_bytes} bytes held on the accelerator")
    where = (
        f"plain self.log held up to {plain.probe.plain_accelerator_bytes} bytes on {context.accelerator}"
        if context.accelerator != "cpu"
        else "the fit ran on the CPU, so nothing could be held on an accelerator"
    )
    detail = "; ".join(problems) or (
        f"{len(probe.cpu_keys)} keys on the CPU in all {probe.reports} reports, 0 bytes on the accelerator ({where})"
    )
    data = {
        "reports": probe.reports,
        "cpu_keys": sorted(probe.cpu_keys),
        "accelerator_bytes": probe.accelerator_bytes,
        "plain_accelerator_bytes": plain.probe.plain_accelerator_bytes,
        "storage_report": [asdict(row) for row in probe.last],
    }
    table = format_storage_report(probe.last, width=terminal_width() - len(INDENT))
    return Outcome("FAIL" if problems else "PASS", detail, data, table)
