"""Checks 3 and 4, on CUDA: no host sync inside ``self.log(..., store_on_cpu=True)``; ``sync_dist`` through NCCL."""

import contextlib
import warnings
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

import pytorch_lightning as pl
import torch

from lightning_store import StoreOnCPUMixin, _buffer
from lightning_store._selfcheck._core import Context, Outcome, Skip
from lightning_store._selfcheck._fits import batches, make_trainer, one_process_group, quiet
from lightning_store._selfcheck._values import FROM_CPU, ValuesModel, compare_runs, fit_and_record

KEYS = 10
STEPS = 30
_SYNC_WARNING = "synchronizing CUDA operation"  # what `torch.cuda.set_sync_debug_mode("warn")` warns


def require_cuda(context: Context, what: str) -> None:
    """Raise :class:`Skip` unless the self-check runs on CUDA.

    Raises:
        Skip: with the reason, naming ``what`` needs CUDA.
    """
    if context.accelerator != "cuda":
        why_not = "no CUDA device was found" if not torch.cuda.is_available() else f"--device {context.accelerator}"
        raise Skip(f"needs CUDA, and {why_not}: {what}")


class _BlockedWaits:
    """Counts the waits of the CPU buffer for a copy that had not landed, installed for one fit then removed.

    Such a wait is ``cudaEventSynchronize``: a host sync that ``torch.cuda.set_sync_debug_mode`` does not report.
    """

    def __init__(self) -> None:
        self.count = 0

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        original = _buffer._Slot.wait

        def wait(slot: _buffer._Slot) -> torch.Tensor:
            self.count += not slot.ready()
            return original(slot)

        _buffer._Slot.wait = wait  # type: ignore[method-assign,assignment]
        try:
            yield
        finally:
            _buffer._Slot.wait = original  # type: ignore[method-assign]


def host_syncs(call: Callable[[], None], blocked: _BlockedWaits) -> int:
    """The host-device syncs made inside ``call()``: those torch reports, and the buffer's blocked waits."""
    before = blocked.count
    previous = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            call()
        finally:
            torch.cuda.set_sync_debug_mode(previous)
    return sum(_SYNC_WARNING in str(w.message) for w in caught) + blocked.count - before


class SyncCountModel(StoreOnCPUMixin, pl.LightningModule):
    """Logs ``KEYS`` device tensors per step twice, stored on the CPU and as usual, counting the syncs of each call."""

    def __init__(self, blocked: _BlockedWaits) -> None:
        super().__init__()
        self.net = torch.nn.Linear(4, 1)
        self.blocked = blocked
        self.stored: list[int] = []  # syncs per step inside the `store_on_cpu=True` calls
        self.plain: list[int] = []  # the same for the plain calls

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        values = [loss.detach() * k for k in range(KEYS)]
        stored = plain = 0
        for k, value in enumerate(values):
            log = partial(self.log, value=value, on_step=True, on_epoch=True, batch_size=len(x))
            stored += host_syncs(partial(log, f"cpu_{k}", store_on_cpu=True), self.blocked)
            plain += host_syncs(partial(log, f"dev_{k}"), self.blocked)
        self.stored.append(stored)
        self.plain.append(plain)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def check_no_sync(context: Context) -> Outcome:
    """Check 3: no host sync inside ``self.log(..., store_on_cpu=True)``, and no more than plain at any step.

    The first step is reported apart: there Lightning registers each key (for both ways of logging alike).
    """
    require_cuda(context, "host syncs are counted with torch.cuda.set_sync_debug_mode")
    blocked = _BlockedWaits()
    model = SyncCountModel(blocked)
    with quiet(), blocked.installed():
        make_trainer(context, max_epochs=1).fit(model, batches(STEPS))
    if len(model.stored) < 2:
        raise RuntimeError(f"the fit ran {len(model.stored)} steps instead of {STEPS}")
    stored, plain = sum(model.stored[1:]), sum(model.plain[1:])
    worse = [step for step, (s, p) in enumerate(zip(model.stored, model.plain, strict=True)) if s > p]
    detail = (
        f"{stored} host syncs in self.log(..., store_on_cpu=True) after the first step, {plain} in plain self.log"
        f" ({len(model.stored) - 1} steps x {KEYS} keys); first step, where Lightning registers the keys:"
        f" {model.stored[0]} and {model.plain[0]}"
    )
    if worse:
        detail += f"; more than plain self.log at steps {worse[:5]}"
    data = {
        "stored_syncs_per_step": model.stored,
        "plain_syncs_per_step": model.plain,
        "keys": KEYS,
        "counted": "torch.cuda.set_sync_debug_mode('warn') warnings, plus the CPU buffer's waits for a copy not yet"
        " landed (cudaEventSynchronize, which that mode does not report)",
    }
    return Outcome("FAIL" if stored or worse else "PASS", detail, data)


def check_nccl_sync_dist(context: Context) -> Outcome:
    """Check 4: ``sync_dist=True`` through a real NCCL process group gives the same values with and without it."""
    require_cuda(context, "NCCL runs on CUDA devices only")
    if not torch.distributed.is_available() or not torch.distributed.is_nccl_available():
        raise Skip("this torch build has no NCCL")
    return sync_dist_outcome(context, expected_backend="nccl")


def sync_dist_outcome(context: Context, expected_backend: str) -> Outcome:
    """Two one-process ``ddp`` fits with ``sync_dist=True``: plain, and stored on the CPU with a value from the CPU.

    On the CPU this runs on gloo, which takes CPU tensors: the tests use it to check the check itself.
    """
    records = []
    for store in (False, True):
        torch.manual_seed(0)
        with one_process_group():
            model = ValuesModel(store_on_cpu=store, sync_dist=True, from_cpu=store)
            records.append(fit_and_record(context, model, ddp=True))
    plain, stored = records
    comparison, from_cpu = compare_runs(plain, stored, context.accelerator)
    rtol = 0.0 if context.accelerator == "cpu" else 1e-6
    problems = []
    if {plain.backend, stored.backend} != {expected_backend}:
        problems.append(f"process-group backends {plain.backend!r} and {stored.backend!r}, not {expected_backend!r}")
    if not comparison.passed(rtol):
        problems.append(f"values: {comparison.describe()}")
    if from_cpu is None or not from_cpu.compared or not from_cpu.passed(rtol):
        problems.append(f"value logged from the CPU: {from_cpu.describe() if from_cpu else 'not logged'}")
    unsynced = [row.name for row in stored.probe.last if row.kind == "tensor" and not row.sync_dist]
    if unsynced:
        problems.append(f"keys that did not sync: {unsynced}")
    if stored.probe.off_cpu or stored.probe.accelerator_bytes:
        problems.append(f"CPU-stored keys seen off the CPU: {sorted(stored.probe.off_cpu)}")
    detail = "; ".join(problems) or (
        f"{comparison.describe()}, and the value logged from the CPU ({from_cpu.compared if from_cpu else 0} values)"
        f" too, in one-process ddp fits on {expected_backend}; CPU-stored keys stayed on the CPU"
    )
    data = {
        "backend": stored.backend,
        "values": comparison.as_data(),
        "from_cpu": from_cpu.as_data() if from_cpu else None,
        "from_cpu_key_suffix": FROM_CPU,
    }
    return Outcome("FAIL" if problems else "PASS", detail, data)
