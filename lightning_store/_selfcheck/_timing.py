"""Check 5: the step time of ``store_on_cpu=True`` over plain ``self.log``, with Lightning's progress bar on."""

import statistics
import time
from typing import Any

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import Callback

from lightning_store import StoreOnCPUMixin
from lightning_store._selfcheck._core import Context, Outcome
from lightning_store._selfcheck._fits import batches, make_trainer, quiet, synchronize

KEYS = 8
STEPS = 30
ROUNDS = 4


class TimingModel(StoreOnCPUMixin, pl.LightningModule):
    """A small MLP that logs ``KEYS`` values per step (two in the progress bar), plainly or stored on the CPU."""

    def __init__(self, store_on_cpu: bool) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(4, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
        self.store = store_on_cpu

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        for k in range(KEYS):
            value = loss.detach() + k
            self.log(f"key_{k}", value, prog_bar=k < 2, on_step=True, on_epoch=True, store_on_cpu=self.store)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


class StepTimer(Callback):
    """The time per step of the second epoch (the first warms up), the device synchronised at its ends only."""

    def __init__(self) -> None:
        self.step_s = float("nan")
        self._start = 0.0

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        synchronize(pl_module.device)
        self._start = time.perf_counter()

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        synchronize(pl_module.device)
        if trainer.current_epoch == 1:
            self.step_s = (time.perf_counter() - self._start) / trainer.num_training_batches


def _step_time(context: Context, store_on_cpu: bool) -> float:
    timer = StepTimer()
    with quiet():
        # Lightning's defaults for the step: the progress bar reads every step value at every step
        trainer = make_trainer(context, enable_progress_bar=True, enable_model_summary=True, callbacks=[timer])
        trainer.fit(TimingModel(store_on_cpu), batches(STEPS))
    return timer.step_s


def check_step_time(context: Context) -> Outcome:
    """Check 5, a measurement: the ratio of the median step times over fits alternated round by round."""
    times: dict[bool, list[float]] = {False: [], True: []}
    for store in (False, True):  # warm-up fits, not counted: the first fits of a process run slower
        _step_time(context, store)
    for round_ in range(ROUNDS):
        for store in (False, True) if round_ % 2 == 0 else (True, False):
            times[store].append(_step_time(context, store))
    plain, stored = statistics.median(times[False]), statistics.median(times[True])
    ratio = stored / plain
    detail = (
        f"store_on_cpu=True / plain = {ratio:.2f} ({stored * 1e3:.2f} ms vs {plain * 1e3:.2f} ms per step;"
        f" medians of {ROUNDS} fits each, {KEYS} keys, {STEPS} steps, progress bar on)"
    )
    data = {"ratio": ratio, "stored_step_s": times[True], "plain_step_s": times[False], "keys": KEYS, "steps": STEPS}
    return Outcome("INFO", detail, data)
