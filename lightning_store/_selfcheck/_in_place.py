"""Check 7, on CUDA: a value changed in place right after ``self.log`` or ``update`` is kept as it was at the call."""

from typing import Any

import torch
from torchmetrics import Metric
from torchmetrics.utilities.data import dim_zero_cat

from lightning_store import store_states_on_cpu
from lightning_store._selfcheck._compare import Comparison, compare
from lightning_store._selfcheck._core import Context, Outcome
from lightning_store._selfcheck._cuda import require_cuda
from lightning_store._selfcheck._metric import _Configure, _list_state
from lightning_store._selfcheck._values import FitRecord, ValuesModel, fit_and_record

BUSY_CYCLES = 2_000_000  # of `torch.cuda._sleep`: about a millisecond of GPU work queued before each call
KEYS = ("changed", "running")  # the keys logged, then changed in place
UPDATES = 20
ELEMENTS = 2**20  # a list element of 4 MiB: its copy takes long enough to race a change made at once


def _busy(device: torch.device) -> None:
    """Queue GPU work before a copy and a change: both wait behind it, then start at once, and would race."""
    if device.type == "cuda":
        torch.cuda._sleep(BUSY_CYCLES)


class InPlaceModel(ValuesModel):
    """Logs a fresh tensor and a module buffer every step, then changes both in place at once."""

    running: torch.Tensor

    def __init__(self, store_on_cpu: bool) -> None:
        super().__init__(store_on_cpu)
        self.register_buffer("running", torch.zeros(()))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        changed = loss.detach() * 3
        self.running.add_(x.sum())  # a buffer changed in place on every step
        _busy(self.device)
        # "max": the epoch value is exact on any device, so every value compares bit for bit
        self._log("changed", changed, reduce_fx="max", on_step=True, on_epoch=True)
        self._log("running", self.running, reduce_fx="max", on_step=True, on_epoch=True)
        changed.zero_()
        self.running.mul_(0.5)
        return loss


class KeepsItsInputs(Metric):
    """Keeps each input itself as its list-state element, as ``CatMetric`` keeps a float32 input."""

    full_state_update = False
    inputs: list[torch.Tensor]

    def __init__(self) -> None:
        super().__init__()
        self.add_state("inputs", default=[], dist_reduce_fx="cat")

    def update(self, value: torch.Tensor) -> None:
        self.inputs.append(value)

    def compute(self) -> torch.Tensor:
        return dim_zero_cat(self.inputs)


def _logged(record: FitRecord) -> dict[str, float]:
    return {key: value for key, value in record.values.items() if key.split(": ", 1)[1].startswith(KEYS)}


def _logged_runs(context: Context) -> Comparison:
    records = []
    for store in (False, True):
        torch.manual_seed(0)
        records.append(fit_and_record(context, InPlaceModel(store_on_cpu=store)))
    plain, stored = records
    return compare(_logged(plain), _logged(stored), 0.0)


def _metric_run(context: Context, configure: _Configure) -> tuple[int, bool]:
    """Inputs changed in place right after a configured Metric's ``update``, against a plain Metric fed copies.

    A plain Metric on the device would see the change through its element; the configured one must keep the input
    as it was at ``update``, as ``compute_on_cpu=True`` does.

    Returns:
        How many elements of the computed value differ, and whether every list-state element was on the CPU.
    """
    device = torch.device("cuda", torch.cuda.current_device()) if context.accelerator == "cuda" else torch.device("cpu")
    configured, plain = configure(KeepsItsInputs()).to(device), KeepsItsInputs().to(device)
    generator = torch.Generator(device).manual_seed(0)
    for step in range(UPDATES):
        value = torch.randn(ELEMENTS, device=device, generator=generator)
        plain.update(value.clone())  # the input as it was at the configured Metric's update
        _busy(device)
        configured.update(value)
        if step % 2:
            value.mul_(-2)
        else:
            value.zero_()
    got, want = configured.compute(), plain.compute().cpu()
    on_cpu = all(t.is_cpu for t in _list_state(configured, "inputs"))
    return (int((got.cpu() != want).sum()) if got.shape == want.shape else want.numel()), on_cpu


def in_place_outcome(context: Context, configure: _Configure | None) -> Outcome:
    """Plain and ``store_on_cpu=True`` fits logging values changed in place at once; the same for a Metric.

    Args:
        context: the self-check's context.
        configure: ``store_states_on_cpu``, or ``None``: the logged values only, no Metric checked.
    """
    logged = _logged_runs(context)
    problems = []
    if not logged.compared or not logged.passed(0.0):
        problems.append(f"logged values: {logged.describe() if logged.compared else 'none compared'}")
    data: dict[str, Any] = {"logged": logged.as_data(), "metric_updates": 0}
    metric = "; no Metric checked"
    if configure is not None:
        different, on_cpu = _metric_run(context, configure)
        data.update(metric_updates=UPDATES, metric_elements_different=different, metric_states_on_cpu=on_cpu)
        if different:
            problems.append(f"a Metric's list state: {different} of {UPDATES * ELEMENTS} elements saw the change")
        if not on_cpu:
            problems.append("a Metric's list state was not on the CPU")
        metric = f"; {UPDATES} Metric list-state elements changed in place right after update, kept as they were"
    detail = "; ".join(problems) or (
        f"{logged.describe()}, each logged right before a change in place, as plain self.log logs them{metric}"
    )
    return Outcome("FAIL" if problems else "PASS", detail, data)


def check_in_place(context: Context) -> Outcome:
    """Check 7: a value changed in place right after the call is kept as it was, logged or in a list state."""
    require_cuda(context, "the copies to the CPU run on a side stream on CUDA only")
    return in_place_outcome(context, store_states_on_cpu)
