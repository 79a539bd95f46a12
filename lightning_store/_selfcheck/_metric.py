"""Check 6: ``store_states_on_cpu`` keeps a Metric's list states on the CPU, same values, NCCL sync."""

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytorch_lightning as pl
import torch
from torchmetrics import Metric
from torchmetrics.classification import BinaryAUROC

from lightning_store import store_states_on_cpu
from lightning_store._selfcheck._compare import Comparison, compare
from lightning_store._selfcheck._core import Context, Outcome
from lightning_store._selfcheck._cuda import require_cuda
from lightning_store._selfcheck._fits import batches, make_trainer, one_process_group, quiet
from lightning_store.metrics._reads import _settle_states

# AUROC sorts and sums on the device of its states: the CPU-stored states sum on the CPU, in another order
RTOL = 1e-5
_Configure = Callable[[Metric], Metric]


class MetricModel(pl.LightningModule):
    """Updates a ``BinaryAUROC(thresholds=None)`` (list states) every step and computes it every epoch.

    After each step it reads the metric's list states: how many tensors, and the bytes held off the CPU.
    """

    def __init__(self, configure: _Configure | None) -> None:
        super().__init__()
        self.net = torch.nn.Linear(4, 1)
        metric = BinaryAUROC(thresholds=None)
        self.auroc = configure(metric) if configure is not None else metric
        self.values: list[float] = []
        self.state_tensors = 0
        self.off_cpu_bytes = 0  # the most held off the CPU after a step, copies in flight landed
        self.in_flight_bytes = 0  # the same, before they landed
        self.backend = ""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits = self.net(x).squeeze(-1)
        target = (y.squeeze(-1) > 0).long()
        self.auroc.update(logits.detach().sigmoid(), target)
        return torch.nn.functional.binary_cross_entropy_with_logits(logits, target.float())

    def on_train_batch_end(self, *args: Any) -> None:
        self.in_flight_bytes = max(self.in_flight_bytes, self._off_cpu_bytes())
        _settle_states(self.auroc)  # copies in flight are counted where they land, as `storage_report` counts them
        self.off_cpu_bytes = max(self.off_cpu_bytes, self._off_cpu_bytes())

    def _off_cpu_bytes(self) -> int:
        tensors = [t for name in self.auroc._defaults for t in _list_state(self.auroc, name)]
        self.state_tensors = max(self.state_tensors, len(tensors))
        return sum(t.numel() * t.element_size() for t in tensors if t.device.type != "cpu")

    def on_train_epoch_end(self) -> None:
        self.values.append(float(self.auroc.compute().item()))
        self.auroc.reset()

    def on_train_start(self) -> None:
        distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
        self.backend = str(torch.distributed.get_backend()) if distributed else ""

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _list_state(metric: Metric, name: str) -> list[torch.Tensor]:
    state = getattr(metric, name)
    return [t for t in state if isinstance(t, torch.Tensor)] if isinstance(state, list) else []


@dataclass
class _MetricRuns:
    plain: MetricModel
    stored: MetricModel
    comparison: Comparison


def _metric_runs(context: Context, configure: _Configure, ddp: bool) -> _MetricRuns:
    models = []
    for with_option in (False, True):
        torch.manual_seed(0)
        model = MetricModel(configure if with_option else None)
        with one_process_group() if ddp else contextlib.nullcontext(), quiet():
            make_trainer(context, ddp=ddp).fit(model, batches(10))
        models.append(model)
    plain, stored = models
    values = {f"epoch {i}": v for i, v in enumerate(plain.values)}
    comparison = compare(values, {f"epoch {i}": v for i, v in enumerate(stored.values)}, RTOL)
    return _MetricRuns(plain, stored, comparison)


def _verdict(runs: _MetricRuns, context: Context, suffix: str) -> Outcome:
    rtol = 0.0 if context.accelerator == "cpu" else RTOL
    stored = runs.stored
    problems = []
    if not runs.comparison.passed(rtol):
        problems.append(f"AUROC: {runs.comparison.describe()}")
    if not stored.state_tensors:
        problems.append("the metric kept no list state to check")
    if stored.off_cpu_bytes:
        problems.append(f"its list states held {stored.off_cpu_bytes} bytes off the CPU")
    on_device = (
        f" (at most {stored.in_flight_bytes} in copies still in flight; without the option"
        f" {runs.plain.off_cpu_bytes} bytes on {context.accelerator})"
        if context.accelerator != "cpu"
        else ""
    )
    detail = "; ".join(problems) or (
        f"BinaryAUROC(thresholds=None): {runs.comparison.describe()} (one per epoch);"
        f" up to {stored.state_tensors} list-state tensors, all on the CPU, 0 bytes on the accelerator{on_device}"
        f"{suffix}"
    )
    data = {
        "values": runs.comparison.as_data(),
        "state_tensors": stored.state_tensors,
        "accelerator_bytes": stored.off_cpu_bytes,
        "in_flight_bytes": stored.in_flight_bytes,
        "plain_accelerator_bytes": runs.plain.off_cpu_bytes,
    }
    return Outcome("FAIL" if problems else "PASS", detail, data)


def check_metric_states(context: Context) -> Outcome:
    """Check 6: ``store_states_on_cpu(metric)`` gives the same values, with its list states on the CPU."""
    return _verdict(_metric_runs(context, store_states_on_cpu, ddp=False), context, "")


def check_metric_nccl_sync(context: Context) -> Outcome:
    """Check 6, on CUDA: the same through a one-process ``ddp`` fit, where the metric syncs through NCCL."""
    require_cuda(context, "NCCL runs on CUDA devices only")
    return metric_sync_outcome(context, store_states_on_cpu, expected_backend="nccl")


def metric_sync_outcome(context: Context, configure: _Configure, expected_backend: str) -> Outcome:
    """Plain and configured metrics in one-process ``ddp`` fits, each ``compute`` gathering through the backend."""
    runs = _metric_runs(context, configure, ddp=True)
    outcome = _verdict(runs, context, f", synced through {expected_backend}")
    backends = {runs.plain.backend, runs.stored.backend}
    if backends != {expected_backend}:
        outcome.status = "FAIL"
        outcome.detail = f"process-group backends {sorted(backends)}, not {expected_backend!r}; {outcome.detail}"
    outcome.data["backend"] = runs.stored.backend
    return outcome
