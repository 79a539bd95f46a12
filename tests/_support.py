"""Modules, data, a recording logger and a manual transfer, shared by the tests and the DDP worker script."""

import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from pytorch_lightning.loggers import Logger
from torch.utils.data import DataLoader, TensorDataset

from lightning_store import StoreOnCPUMixin

REDUCTIONS = ("mean", "sum", "max", "min")
LEVELS = ((True, False), (False, True), (True, True))  # (on_step, on_epoch)


def free_port() -> int:
    """A TCP port on the loopback that nothing listens on, for a process group's rendezvous."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_worker(worker: Path, out: Path, **env: str) -> subprocess.Popen:
    """Start ``worker`` (a script beside this file) on ``out``, in a process group of its own, on the loopback.

    The environment is this one's, with this checkout on ``PYTHONPATH``, no rank variables but those in ``env``.
    """
    full = {**os.environ, "MASTER_ADDR": "127.0.0.1", "PYTHONUNBUFFERED": "1"}
    for name in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "RANK"):
        full.pop(name, None)
    full["PYTHONPATH"] = os.pathsep.join(filter(None, [str(worker.parent.parent), full.get("PYTHONPATH")]))
    return subprocess.Popen(
        [sys.executable, str(worker), str(out)],
        env={**full, **env},
        cwd=worker.parent,
        start_new_session=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def loader(n: int = 10, batch_size: int = 4, seed: int = 0) -> DataLoader:
    """Batches of 4, 4 and 2 rows, so a mean weighted by batch size differs from a plain mean."""
    generator = torch.Generator().manual_seed(seed)
    return DataLoader(TensorDataset(torch.randn(n, 3, generator=generator)), batch_size=batch_size)


class RecordingLogger(Logger):
    """Keeps every ``log_metrics`` call, values as handed over (tensors or numbers)."""

    def __init__(self) -> None:
        super().__init__()
        self.history: list[tuple[int | None, dict[str, Any]]] = []

    @property
    def name(self) -> str:
        return "recording"

    @property
    def version(self) -> int:
        return 0

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.history.append((step, dict(metrics)))


class LoggingModel(StoreOnCPUMixin, pl.LightningModule):
    """Logs every reduction at every level in training, validation and test, from tensors and from numbers.

    Args:
        store_on_cpu: passed to every ``self.log`` call (``None``: not passed).
        explicit_batch_size: pass ``batch_size`` to ``self.log`` instead of letting Lightning infer it.
        check_storage: after each call, assert that every tensor kept for a key stored on the CPU is on the CPU.
    """

    def __init__(
        self, store_on_cpu: bool | None = True, explicit_batch_size: bool = False, check_storage: bool = True
    ) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(3, 1)
        self.store = store_on_cpu
        self.explicit_batch_size = explicit_batch_size
        self.check_storage = check_storage
        self.checked_keys: set[str] = set()
        self.model_devices: set[str] = set()
        self.callback_devices: set[str] = set()  # of `trainer.callback_metrics` values, seen during training

    def _log_everything(self, stage: str, batch: Any, batch_idx: int) -> torch.Tensor:
        (x,) = batch
        out = self.layer(x)
        loss = out.pow(2).mean()
        kwargs = {} if self.store is None else {"store_on_cpu": self.store}
        if self.explicit_batch_size:
            kwargs["batch_size"] = len(x)
        for reduce_fx in REDUCTIONS:
            for on_step, on_epoch in LEVELS:
                suffix = f"{reduce_fx}_{int(on_step)}{int(on_epoch)}"
                self.log(
                    f"{stage}_{suffix}",
                    x[:, 0].mean() + batch_idx,
                    reduce_fx=reduce_fx,
                    on_step=on_step,
                    on_epoch=on_epoch,
                    prog_bar=reduce_fx == "mean",
                    **kwargs,
                )
                self.log(
                    f"{stage}_num_{suffix}",
                    float(batch_idx) * 0.5 - 1,
                    reduce_fx=reduce_fx,
                    on_step=on_step,
                    on_epoch=on_epoch,
                    **kwargs,
                )
        self.log(f"{stage}_loss", loss, **kwargs)
        self._check_storage()
        self.model_devices.add(self.device.type)
        return loss

    def _check_storage(self) -> None:
        if not self.check_storage or not self.store:
            return
        from lightning_store._result import _StoredOnCPU

        for key, result in self.trainer._results.items():
            if not result.is_tensor:
                continue
            assert isinstance(result, _StoredOnCPU), key
            for tensor in stored_tensors(result):
                assert tensor.device.type == "cpu", (key, tensor.device)
            self.checked_keys.add(key)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self._log_everything("train", batch, batch_idx)

    def validation_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        self._log_everything("val", batch, batch_idx)

    def test_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        self._log_everything("test", batch, batch_idx)

    def on_train_epoch_end(self) -> None:
        self.callback_devices.update(value.device.type for value in self.trainer.callback_metrics.values())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def stored_tensors(result: Any) -> Iterator[torch.Tensor]:
    """Every tensor a ``_ResultMetric`` keeps: its states, step value and computed value."""
    for name in ("value", "cumulated_batch_size", "_forward_cache", "_computed"):
        tensor = getattr(result, name, None)
        if isinstance(tensor, torch.Tensor):
            yield tensor


def assert_same(a: dict[str, Any], b: dict[str, Any]) -> None:
    """Same keys, and the same values bit for bit (tensors compared with ``torch.equal``, NaN equal to NaN)."""
    assert sorted(a) == sorted(b)
    for key in a:
        left, right = a[key], b[key]
        if isinstance(left, torch.Tensor):
            assert isinstance(right, torch.Tensor), key
            assert left.dtype == right.dtype, key
            assert torch.equal(left, right) or (left.isnan().all() and right.isnan().all()), (key, left, right)
        else:
            assert left == right, (key, left, right)


class ManualCopy:
    """A device-to-host copy that lands only when the test says so (or when waited for)."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self._source = tensor.detach().to("cpu", copy=True)
        self.host = _garbage(self._source.clone())  # what a read before landing would see
        self.landed = False
        self.waited = False
        self.released = False

    def land(self) -> None:
        self.host.copy_(self._source)
        self.landed = True

    def ready(self) -> bool:
        return self.landed

    def wait(self) -> torch.Tensor:
        self.waited = True
        if not self.landed:
            self.land()
        return self.host

    def release(self) -> None:
        self.released = True
        _garbage(self.host)  # memory handed back for reuse: a kept reference would read garbage


class ManualTransfer:
    """Checks the CPU buffer's logic on the CPU, with copies whose completion the test controls."""

    def __init__(self) -> None:
        self.copies: list[ManualCopy] = []

    def start(self, tensor: torch.Tensor) -> ManualCopy:
        copy = ManualCopy(tensor)
        self.copies.append(copy)
        return copy


def _garbage(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.fill_(float("nan") if tensor.is_floating_point() else -(2**31))
