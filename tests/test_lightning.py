"""The ``lightning.pytorch`` namespace: the mixin on its LightningModule, and its Trainer with the flag."""

import builtins
import importlib
import importlib.metadata
import sys

import pytest
import torch
from _support import assert_same, loader

L = pytest.importorskip("lightning.pytorch")

from torchmetrics.classification import BinaryAUROC  # noqa: E402

from lightning_store import StoreOnCPUDeprecationWarning, StoreOnCPUMixin, _compat  # noqa: E402
from lightning_store._logged.result import _StoredOnCPU  # noqa: E402
from lightning_store.lightning import Trainer  # noqa: E402
from lightning_store.metrics._reads import _stores_states_on_cpu  # noqa: E402


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


class PlainModel(L.LightningModule):
    """A module of the `lightning.pytorch` namespace without the mixin, as a Lightning 1.x project has them."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layer = torch.nn.Linear(3, 1)
        self.auroc = BinaryAUROC(thresholds=None)

    def training_step(self, batch, batch_idx):
        loss = self.layer(batch[0]).pow(2).mean()
        self.log("loss", loss, on_step=True, on_epoch=True)
        self.log_dict({"peak": loss, "low": -loss}, reduce_fx="max")
        self.auroc.update(torch.sigmoid(self.layer(batch[0])).squeeze(1), (batch[0][:, 0] > 0).long())
        return loss

    def on_train_epoch_end(self):
        self.log("auroc", self.auroc.compute())
        self.auroc.reset()

    def validation_step(self, batch, batch_idx):
        self.log("val", batch[0].mean())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_the_flag_stores_a_plain_lightning_pytorch_module_on_cpu_with_the_values_of_lightning(quiet_trainer_kwargs):
    plain = _fit(L.Trainer, quiet_trainer_kwargs, PlainModel())
    model = PlainModel()
    with pytest.warns(StoreOnCPUDeprecationWarning):
        stored = _fit(Trainer, quiet_trainer_kwargs, model, move_metrics_to_cpu=True)
    assert _stored_keys(stored) == [
        "on_train_epoch_end.auroc",
        "training_step.loss",
        "training_step.low",
        "training_step.peak",
        "validation_step.val",
    ]
    assert_same(dict(plain.callback_metrics), dict(stored.callback_metrics))
    assert type(model) is PlainModel and _stores_states_on_cpu(model.auroc)
    assert [type(c).__mro__[2].__module__ for c in stored.callbacks if "MoveMetrics" in type(c).__name__] == [
        "lightning.pytorch.callbacks.callback"
    ]


@pytest.mark.parametrize("method", ["fit", "validate", "test", "predict"])
def test_the_pytorch_lightning_trainer_refuses_a_lightning_pytorch_module_naming_the_import(
    method, quiet_trainer_kwargs
):
    import lightning_store

    trainer = lightning_store.Trainer(**quiet_trainer_kwargs, max_epochs=1)
    expected = (
        "`lightning_store.Trainer` is a `pytorch_lightning.Trainer`, and `PlainModel` is a"
        " `lightning.pytorch.LightningModule`: a Trainer takes the LightningModules of its own Lightning namespace"
        " only. HINT: `from lightning_store.lightning import Trainer`, the same Trainer for `lightning.pytorch`."
    )
    with pytest.raises(TypeError) as info:
        getattr(trainer, method)(PlainModel(), loader())
    assert str(info.value) == expected
    with pytest.raises(TypeError) as info:
        trainer.fit(model=torch.compile(PlainModel()))  # by keyword, and compiled
    assert str(info.value) == expected
    # the hint, followed: the values of plain Lightning, with the flag too
    plain = _fit(L.Trainer, quiet_trainer_kwargs, PlainModel())
    with pytest.warns(StoreOnCPUDeprecationWarning):
        stored = _fit(Trainer, quiet_trainer_kwargs, PlainModel(), move_metrics_to_cpu=True)
    assert_same(dict(plain.callback_metrics), dict(stored.callback_metrics))


def test_the_lightning_pytorch_trainer_refuses_a_pytorch_lightning_module_naming_the_import(quiet_trainer_kwargs):
    import pytorch_lightning as pl
    from _support import PlainLoggingModel

    import lightning_store

    trainer = Trainer(**quiet_trainer_kwargs, max_epochs=1)
    with pytest.raises(TypeError) as info:
        trainer.fit(PlainLoggingModel(), loader())
    assert str(info.value) == (
        "`lightning_store.lightning.Trainer` is a `lightning.pytorch.Trainer`, and `PlainLoggingModel` is a"
        " `pytorch_lightning.LightningModule`: a Trainer takes the LightningModules of its own Lightning namespace"
        " only. HINT: `from lightning_store import Trainer`, the same Trainer for `pytorch_lightning`."
    )
    # the hint, followed: the values of plain Lightning, with the flag too
    torch.manual_seed(0)
    plain = _fit(pl.Trainer, quiet_trainer_kwargs, PlainLoggingModel())
    torch.manual_seed(0)
    model = PlainLoggingModel()
    with pytest.warns(StoreOnCPUDeprecationWarning):
        stored = _fit(lightning_store.Trainer, quiet_trainer_kwargs, model, move_metrics_to_cpu=True)
    assert_same(dict(plain.callback_metrics), dict(stored.callback_metrics))


def _import_lightning_store_lightning(monkeypatch):
    monkeypatch.delitem(sys.modules, "lightning_store.lightning")
    return importlib.import_module("lightning_store.lightning")


def test_not_installed_is_said_only_when_lightning_is_not_installed(monkeypatch):
    monkeypatch.setitem(sys.modules, "lightning", None)  # `import lightning` fails as if it were absent
    monkeypatch.setattr(_compat, "version", _not_installed)
    with pytest.raises(ImportError, match=r"is for the `lightning` package, which is not installed"):
        _import_lightning_store_lightning(monkeypatch)


def test_an_installed_lightning_that_fails_to_import_shows_the_real_cause(monkeypatch):
    monkeypatch.setitem(sys.modules, "lightning.pytorch", None)  # installed (2.6.6 here), but the import fails
    with pytest.raises(ImportError) as info:
        _import_lightning_store_lightning(monkeypatch)
    message = str(info.value)
    assert message.startswith(f"`lightning` {importlib.metadata.version('lightning')} is installed, but")
    assert "not installed" not in message
    assert isinstance(info.value.__cause__, ImportError) and "lightning.pytorch" in str(info.value.__cause__)


def test_a_missing_pkg_resources_gets_its_hint(monkeypatch):
    monkeypatch.setitem(sys.modules, "lightning.pytorch", None)
    monkeypatch.setitem(sys.modules, "pkg_resources", None)
    real_import = builtins.__import__

    def import_needing_pkg_resources(name, *args, **kwargs):
        if name == "lightning.pytorch":
            import pkg_resources  # noqa: F401  (raises: None in sys.modules, as when setuptools lacks it)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", import_needing_pkg_resources)
    with pytest.raises(ImportError, match=r"failed: .*pkg_resources.* HINT: Lightning releases before 2\.4 import"):
        _import_lightning_store_lightning(monkeypatch)


def test_a_release_outside_the_range_is_named_first(monkeypatch):
    monkeypatch.setitem(sys.modules, "lightning.pytorch", None)
    monkeypatch.setattr(_compat, "version", lambda distribution: "2.0.9")
    with pytest.raises(ImportError, match=r"lightning-store supports lightning>=2\.1\.1,<2\.7, but lightning 2\.0\.9"):
        _import_lightning_store_lightning(monkeypatch)


def _not_installed(distribution):
    raise importlib.metadata.PackageNotFoundError(distribution)
