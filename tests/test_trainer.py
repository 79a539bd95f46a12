import inspect
import pickle
import warnings

import numpy as np
import pytest
import pytorch_lightning as pl
import torch
from _support import CLI_AVAILABLE, CLI_REASON, LoggingModel, assert_same, loader

from lightning_store import StoreOnCPUDeprecationWarning, StoreOnCPUMixin, StoreOnCPUWarning, Trainer, _compat
from lightning_store._logged.collection import _StoringResults
from lightning_store._logged.result import _StoredOnCPU


def _stored(trainer):
    results = trainer.fit_loop.epoch_loop._results
    return {key.split(".", 1)[1] for key, result in results.items() if isinstance(result, _StoredOnCPU)}


def test_flag_warns_once_that_it_is_deprecated_and_names_the_replacement(quiet_trainer_kwargs):
    with pytest.warns(StoreOnCPUDeprecationWarning, match=r"Use `self.log\(..., store_on_cpu=True\)`") as record:
        Trainer(move_metrics_to_cpu=True, **quiet_trainer_kwargs)
        Trainer(move_metrics_to_cpu=True, **quiet_trainer_kwargs)
    assert len([w for w in record if issubclass(w.category, StoreOnCPUDeprecationWarning)]) == 1
    assert issubclass(StoreOnCPUDeprecationWarning, DeprecationWarning)
    assert record[0].filename == __file__  # points at the user's line


def test_flag_off_does_not_warn(quiet_trainer_kwargs, recwarn):
    trainer = Trainer(move_metrics_to_cpu=False, **quiet_trainer_kwargs)
    assert trainer.move_metrics_to_cpu is False
    assert not [w for w in recwarn if issubclass(w.category, StoreOnCPUDeprecationWarning)]


@pytest.mark.parametrize("bad", [1, "true", None])
def test_flag_must_be_a_bool(bad, quiet_trainer_kwargs):
    with pytest.raises(
        TypeError, match=rf"Expected move_metrics_to_cpu to be a bool, got {bad!r} \({type(bad).__name__}\)"
    ):
        Trainer(move_metrics_to_cpu=bad, **quiet_trainer_kwargs)


def _fit(trainer_kwargs, model, **flag):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", StoreOnCPUDeprecationWarning)
        trainer = Trainer(**trainer_kwargs, max_epochs=1, **flag)
    trainer.fit(model, loader())
    return trainer


def test_flag_makes_store_on_cpu_default_to_true(quiet_trainer_kwargs):
    trainer = _fit(quiet_trainer_kwargs, LoggingModel(store_on_cpu=None), move_metrics_to_cpu=True)
    assert "train_loss" in _stored(trainer) and len(_stored(trainer)) == 25


def test_explicit_store_on_cpu_and_module_default_win_over_the_flag(quiet_trainer_kwargs):
    assert not _stored(_fit(quiet_trainer_kwargs, LoggingModel(store_on_cpu=False), move_metrics_to_cpu=True))

    class ModuleSaysNo(LoggingModel):
        store_on_cpu_default = False

    assert not _stored(_fit(quiet_trainer_kwargs, ModuleSaysNo(store_on_cpu=None), move_metrics_to_cpu=True))


def test_without_the_flag_nothing_is_stored_on_cpu(quiet_trainer_kwargs):
    assert not _stored(_fit(quiet_trainer_kwargs, LoggingModel(store_on_cpu=None)))


class _Plain(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(3, 1)

    def training_step(self, batch, batch_idx):
        loss = self.layer(batch[0]).sum()
        self.log("loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def test_flag_stores_the_keys_of_a_module_without_the_mixin_on_the_cpu(quiet_trainer_kwargs, recwarn):
    trainer = _fit(quiet_trainer_kwargs, _Plain(), move_metrics_to_cpu=True)
    assert type(trainer.lightning_module) is _Plain
    assert _stored(trainer) == {"loss"} and trainer.callback_metrics["loss"].is_cpu
    assert not [w for w in recwarn if issubclass(w.category, StoreOnCPUWarning)]


def test_flag_on_a_metric_gets_no_metric_warning(quiet_trainer_kwargs, recwarn):
    import torchmetrics

    class WithMetric(StoreOnCPUMixin, pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(3, 1)
            self.metric = torchmetrics.MeanMetric()

        def training_step(self, batch, batch_idx):
            self.metric(batch[0].mean())
            self.log("metric", self.metric)
            return self.layer(batch[0]).sum()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    trainer = _fit(quiet_trainer_kwargs, WithMetric(), move_metrics_to_cpu=True)
    assert not [w for w in recwarn if issubclass(w.category, StoreOnCPUWarning)]
    assert not _stored(trainer) and "metric" in trainer.callback_metrics


def test_signature_is_the_lightning_trainers_plus_the_flag():
    ours, base = inspect.signature(Trainer).parameters, inspect.signature(pl.Trainer).parameters
    assert list(ours) == [*base, "move_metrics_to_cpu"]
    assert ours["move_metrics_to_cpu"].default is False


def test_positional_arguments_are_taken_as_by_lightning():
    ours, base = Trainer("cpu", "auto", 1, logger=False), pl.Trainer("cpu", "auto", 1, logger=False)
    assert type(ours.accelerator) is type(base.accelerator)
    assert ours.strategy.root_device == base.strategy.root_device


def test_environment_defaults_apply_to_lightnings_arguments_and_the_flag(monkeypatch, quiet_trainer_kwargs):
    monkeypatch.setenv("PL_TRAINER_MAX_EPOCHS", "7")
    monkeypatch.setenv("PL_TRAINER_MOVE_METRICS_TO_CPU", "True")
    with pytest.warns(StoreOnCPUDeprecationWarning) as record:
        trainer = Trainer(**quiet_trainer_kwargs)
    assert str(record[0].message).endswith("(set by the environment variable PL_TRAINER_MOVE_METRICS_TO_CPU)")
    assert record[0].filename == __file__
    assert trainer.max_epochs == 7
    assert trainer.move_metrics_to_cpu is True


@pytest.mark.skipif(not CLI_AVAILABLE, reason=CLI_REASON)
@pytest.mark.usefixtures("kept_environment")
def test_lightning_cli_accepts_the_flag(tmp_path):
    import pytorch_lightning.cli as cli_module

    args = [
        "--trainer.move_metrics_to_cpu=true",
        "--trainer.max_epochs=2",
        "--trainer.logger=false",
        f"--trainer.default_root_dir={tmp_path}",
    ]
    with pytest.warns(StoreOnCPUDeprecationWarning):
        cli = cli_module.LightningCLI(LoggingModel, trainer_class=Trainer, run=False, args=args)
    assert isinstance(cli.trainer, Trainer)
    assert cli.trainer.move_metrics_to_cpu is True and cli.trainer.max_epochs == 2


@pytest.mark.parametrize(
    ("raw", "expected"), [("1", True), ("0", False), ("True", True), ("false", False), ("", False)]
)
def test_the_flag_takes_what_lightning_takes_from_the_environment(raw, expected, monkeypatch, quiet_trainer_kwargs):
    monkeypatch.setenv("PL_TRAINER_MOVE_METRICS_TO_CPU", raw)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", StoreOnCPUDeprecationWarning)
        trainer = Trainer(**quiet_trainer_kwargs)
    assert trainer.move_metrics_to_cpu is expected


@pytest.mark.parametrize("raw", ["yes", "2", "[1]"])
def test_a_bad_environment_value_is_named_with_its_variable(raw, monkeypatch, quiet_trainer_kwargs):
    monkeypatch.setenv("PL_TRAINER_MOVE_METRICS_TO_CPU", raw)
    expected = (
        f"Expected the environment variable PL_TRAINER_MOVE_METRICS_TO_CPU to be 1, 0, True or False, got {raw!r}."
        " HINT: export PL_TRAINER_MOVE_METRICS_TO_CPU=1 to turn move_metrics_to_cpu on, or unset it."
    )
    with pytest.raises(ValueError) as info:
        Trainer(**quiet_trainer_kwargs)
    assert str(info.value) == expected


def test_an_explicit_flag_wins_over_the_environment(monkeypatch, quiet_trainer_kwargs):
    monkeypatch.setenv("PL_TRAINER_MOVE_METRICS_TO_CPU", "yes")  # not even read
    assert Trainer(move_metrics_to_cpu=False, **quiet_trainer_kwargs).move_metrics_to_cpu is False


def test_a_subclass_reads_its_own_variable_as_lightning_does(monkeypatch, quiet_trainer_kwargs):
    class MyTrainer(Trainer):
        pass

    monkeypatch.setenv("PL_MYTRAINER_MOVE_METRICS_TO_CPU", "1")
    with pytest.warns(StoreOnCPUDeprecationWarning):
        assert MyTrainer(**quiet_trainer_kwargs).move_metrics_to_cpu is True


def test_a_numpy_bool_is_taken_for_the_flag(quiet_trainer_kwargs):
    with pytest.warns(StoreOnCPUDeprecationWarning):
        trainer = Trainer(move_metrics_to_cpu=np.True_, **quiet_trainer_kwargs)
    assert trainer.move_metrics_to_cpu is True


def test_the_flag_applies_to_a_compiled_module(quiet_trainer_kwargs, recwarn):
    # no batch is run: a compiled step would take a minute to compile here, and on torch 2.13 with Lightning 2.6
    # a compiled step that calls `self.log` fails inside dynamo with or without lightning-store
    trainer_kwargs = {**quiet_trainer_kwargs, "limit_train_batches": 0}
    for model in (LoggingModel(store_on_cpu=None), _Plain()):
        trainer = _fit(trainer_kwargs, torch.compile(model), move_metrics_to_cpu=True)
        assert trainer.lightning_module is model
        results = trainer.fit_loop.epoch_loop._results
        assert isinstance(results, _StoringResults) and results._move_metrics_to_cpu is True
    assert not [w for w in recwarn if issubclass(w.category, StoreOnCPUWarning)]


@pytest.mark.parametrize("store_on_cpu", [False, True])
def test_a_fitted_trainer_pickles_with_its_values(store_on_cpu, quiet_trainer_kwargs, monkeypatch):
    trainer = _fit(quiet_trainer_kwargs, LoggingModel(store_on_cpu=store_on_cpu))
    results = trainer.fit_loop.epoch_loop._results
    monkeypatch.setattr(_compat, "_made", {})  # as in a fresh process: the class is made again on load
    loaded = pickle.loads(pickle.dumps(trainer))
    assert_same(dict(trainer.callback_metrics), dict(loaded.callback_metrics))
    reloaded = loaded.fit_loop.epoch_loop._results
    assert list(reloaded) == list(results)
    for key, result in results.items():
        assert isinstance(reloaded[key], _StoredOnCPU) is store_on_cpu
        assert torch.equal(reloaded[key].value, result.value)
        if store_on_cpu:  # still stored on the CPU, with a buffer of its own for the values to come
            assert reloaded[key].value.is_cpu and len(reloaded[key]._buffer) == 0
            assert reloaded[key]._buffer is not result._buffer


_HYDRA_INSTANTIATE = """
def instantiate(target, **kwargs):
    return target(**kwargs)
"""


def test_the_deprecation_points_at_the_users_line_when_a_launcher_builds_the_trainer(quiet_trainer_kwargs, tmp_path):
    # Hydra's `instantiate` (its `_target_`), as in lightning-hydra-template's train.py
    path = tmp_path / "hydra" / "_internal" / "instantiate" / "_instantiate2.py"
    path.parent.mkdir(parents=True)
    path.write_text(_HYDRA_INSTANTIATE)
    launcher = {"__name__": "hydra._internal.instantiate._instantiate2"}
    exec(compile(_HYDRA_INSTANTIATE, str(path), "exec"), launcher)
    with pytest.warns(StoreOnCPUDeprecationWarning) as record:
        line = inspect.currentframe().f_lineno + 1
        launcher["instantiate"](Trainer, move_metrics_to_cpu=True, **quiet_trainer_kwargs)
    (warning,) = [w for w in record if issubclass(w.category, StoreOnCPUDeprecationWarning)]
    assert (warning.filename, warning.lineno) == (__file__, line)
