"""The RFC's own scenarios on a GPU. Skipped without CUDA (CI has none); run them on a device machine."""

import pytest
import pytorch_lightning as pl
import torch
import torchmetrics
from _support import LoggingModel, loader, stored_tensors

from lightning_store import StoreOnCPUMixin, StoreOnCPUWarning
from lightning_store._result import _StoredOnCPU

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.fixture
def gpu_trainer_kwargs(quiet_trainer_kwargs):
    yield {**quiet_trainer_kwargs, "accelerator": "gpu", "max_epochs": 2}
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


class _SyncedLoggingModel(LoggingModel):
    """``LoggingModel`` with ``sync_dist=True`` on every call."""

    def log(self, *args, **kwargs):
        super().log(*args, sync_dist=True, **kwargs)

    def on_train_start(self):
        self.backend = torch.distributed.get_backend()

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        if self.store:  # a CPU tensor with sync_dist: Lightning alone hands it to NCCL (Lightning #18803)
            self.log("cpu_value", loss.detach().cpu(), store_on_cpu=True)
        return loss


def _fit_and_validate(store_on_cpu, trainer_kwargs, strategy="auto", model_class=LoggingModel):
    torch.manual_seed(0)
    model = model_class(store_on_cpu=store_on_cpu)
    trainer = pl.Trainer(**trainer_kwargs, strategy=strategy)
    trainer.fit(model, loader(), [loader(seed=1), loader(n=7, seed=2)])
    seen = {"callback": dict(trainer.callback_metrics), "logged": dict(trainer.logged_metrics)}
    return trainer, model, seen


def _assert_close(a, b):
    assert sorted(a) == sorted(b)
    for key in a:
        torch.testing.assert_close(a[key].cpu(), b[key].cpu(), rtol=1e-6, atol=0, equal_nan=True, msg=key)


def test_state_lives_on_the_cpu_while_the_model_is_on_the_gpu(gpu_trainer_kwargs):
    _, plain_model, on_device = _fit_and_validate(False, gpu_trainer_kwargs)
    _, model, on_cpu = _fit_and_validate(True, gpu_trainer_kwargs)
    assert model.model_devices == plain_model.model_devices == {"cuda"}
    # checked after every call: every tensor kept for every key was on the CPU
    assert {"training_step.train_mean_11", "validation_step.val_sum_01.1"} <= model.checked_keys
    assert model.callback_devices == {"cpu"} and "cuda" in plain_model.callback_devices
    for what in on_device:
        _assert_close(on_device[what], on_cpu[what])


def test_ddp_on_one_gpu_with_nccl_syncs_on_the_device_and_stores_on_the_cpu(gpu_trainer_kwargs):
    """The RFC's bug: the epoch-end reduction ran on CPU tensors ("Tensors must be CUDA and dense")."""
    _, _, on_device = _fit_and_validate(False, gpu_trainer_kwargs, "ddp", _SyncedLoggingModel)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    trainer, model, on_cpu = _fit_and_validate(True, gpu_trainer_kwargs, "ddp", _SyncedLoggingModel)
    assert model.backend == "nccl"
    results = trainer.fit_loop.epoch_loop._results
    assert all(result._sync_runs for result in results.values())
    assert all(isinstance(result, _StoredOnCPU) for result in results.values())
    for what in on_device:
        cpu_value = on_cpu[what].pop("cpu_value")
        assert cpu_value.item() == pytest.approx(on_cpu[what]["train_loss"].item(), rel=1e-6)
        _assert_close(on_device[what], on_cpu[what])


class DummyMetric(torchmetrics.Metric):
    """The RFC's metric: a sum that fails on a device mismatch."""

    def __init__(self):
        super().__init__()
        self.add_state("x", torch.tensor(0), dist_reduce_fx="sum")

    def update(self, x):
        self.x += x

    def compute(self):
        return self.x


class _RFCModel(StoreOnCPUMixin, pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(3, 1)
        self.metric = DummyMetric()
        self.total = 0

    def training_step(self, batch, batch_idx):
        value = (batch[0].abs().sum() * 100).long()
        self.total += int(value)
        self.metric(value)
        self.log("train_loss_2", self.metric, on_epoch=True, store_on_cpu=True)
        self.log("loss", self.layer(batch[0]).sum(), store_on_cpu=True)
        return self.layer(batch[0]).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def test_the_rfcs_dummy_metric_warns_and_keeps_working_on_the_gpu(gpu_trainer_kwargs):
    gpu_trainer_kwargs["max_epochs"] = 1
    model = _RFCModel()
    trainer = pl.Trainer(**gpu_trainer_kwargs)
    with pytest.warns(StoreOnCPUWarning, match="a `torchmetrics.Metric` keeps its state on its own device"):
        trainer.fit(model, loader())
    assert model.metric.x.device.type == "cuda"  # never moved: its next `update` would have failed
    assert trainer.callback_metrics["train_loss_2_epoch"].item() == model.total
    assert trainer.callback_metrics["loss"].device.type == "cpu"


def test_logging_adds_no_host_device_sync_after_the_first_step(gpu_trainer_kwargs):
    class Model(_RFCModel):
        def training_step(self, batch, batch_idx):
            loss = self.layer(batch[0]).sum()
            if batch_idx > 0:
                torch.cuda.set_sync_debug_mode("error")
            try:
                self.log("loss", loss, store_on_cpu=True, batch_size=4)
                self.log("mean", loss * 2, store_on_cpu=True, on_step=False, on_epoch=True, batch_size=4)
            finally:
                torch.cuda.set_sync_debug_mode("default")
            result = self.trainer._results["training_step.mean"]
            assert all(t.device.type == "cpu" for t in stored_tensors(result))
            return loss

    trainer = pl.Trainer(**gpu_trainer_kwargs)
    trainer.fit(Model(), loader(n=40))
    assert trainer.callback_metrics["mean"].device.type == "cpu"
