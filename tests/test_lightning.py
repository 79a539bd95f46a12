"""The ``lightning.pytorch`` namespace: the mixin on its LightningModule, and its Trainer with the flag."""

import pytest
import torch
from _support import assert_same, loader

L = pytest.importorskip("lightning.pytorch")

from lightning_store import StoreOnCPUDeprecationWarning, StoreOnCPUMixin  # noqa: E402
from lightning_store._result import _StoredOnCPU  # noqa: E402
from lightning_store.lightning import Trainer  # noqa: E402


class Model(StoreOnCPUMixin, L.LightningModule):
    def __init__(self, store_on_cpu=None):
        super().__init__()
        torch.manual_seed(0)
        self.layer = torch.nn.Linear(3, 1)
        self.store = store_on_cpu

    def training_step(self, batch, batch_idx):
        loss = self.layer(batch[0]).pow(2).mean()
        self.log("loss", loss, on_step=True, on_epoch=True, store_on_cpu=self.store)
        self.log_dict({"peak": loss, "low": -loss}, reduce_fx="max", store_on_cpu=self.store)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val", batch[0].mean(), store_on_cpu=self.store)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit(trainer_class, trainer_kwargs, model, **flag):
    trainer = trainer_class(**trainer_kwargs, max_epochs=2, **flag)
    trainer.fit(model, loader(), loader(seed=1))
    return trainer


def _stored_keys(trainer):
    loops = (trainer.fit_loop.epoch_loop, trainer.fit_loop.epoch_loop.val_loop)
    return sorted(key for loop in loops for key, result in loop._results.items() if isinstance(result, _StoredOnCPU))


def test_the_mixin_stores_on_cpu_for_a_lightning_pytorch_module(quiet_trainer_kwargs):
    plain = _fit(L.Trainer, quiet_trainer_kwargs, Model(store_on_cpu=False))
    stored = _fit(L.Trainer, quiet_trainer_kwargs, Model(store_on_cpu=True))
    assert _stored_keys(stored) == [
        "training_step.loss",
        "training_step.low",
        "training_step.peak",
        "validation_step.val",
    ]
    result = stored.fit_loop.epoch_loop._results["training_step.loss"]
    assert type(result).__mro__[2].__module__.startswith("lightning.pytorch.")  # the namespace's own class
    assert_same(dict(plain.callback_metrics), dict(stored.callback_metrics))


def test_the_lightning_trainer_takes_the_flag(quiet_trainer_kwargs):
    with pytest.warns(StoreOnCPUDeprecationWarning, match=r"Use `self.log\(..., store_on_cpu=True\)`"):
        trainer = _fit(Trainer, quiet_trainer_kwargs, Model(), move_metrics_to_cpu=True)
    assert isinstance(trainer, L.Trainer) and trainer.move_metrics_to_cpu
    assert len(_stored_keys(trainer)) == 4


def test_the_pytorch_lightning_trainer_refuses_a_lightning_module(quiet_trainer_kwargs):
    import lightning_store

    trainer = lightning_store.Trainer(**quiet_trainer_kwargs, max_epochs=1)
    with pytest.raises(TypeError, match="must be a `LightningModule`"):
        trainer.fit(Model(), loader())
