"""``Trainer(move_metrics_to_cpu=True)`` on LightningModules without the mixin: the values of plain Lightning,
stored on the CPU, the module unchanged, and the list states of its torchmetrics Metrics on the CPU."""

import copy
import inspect
import io
import logging
import pickle
import re
import warnings

import pytest
import pytorch_lightning as pl
import torch
from _support import (
    LoggingCallback,
    PlainLoggingModel,
    all_results,
    assert_same,
    loader,
    run_everything,
    stored_tensors,
)
from pytorch_lightning.callbacks import ModelCheckpoint
from pytorch_lightning.utilities.model_summary import ModelSummary
from torchmetrics import CatMetric, MeanMetric, Metric, MetricCollection
from torchmetrics.classification import BinaryAUROC, BinaryAveragePrecision
from torchmetrics.regression import SpearmanCorrCoef
from torchmetrics.utilities.data import dim_zero_cat
from torchmetrics.wrappers import ClasswiseWrapper, MinMaxMetric

import lightning_store
from lightning_store import (
    StoreOnCPUDeprecationWarning,
    StoreOnCPUWarning,
    Trainer,
    _compat,
)
from lightning_store._flag import hooks as _move_metrics
from lightning_store._logged import collection as _collection
from lightning_store._logged.collection import _StoringResults
from lightning_store._logged.result import _StoredOnCPU
from lightning_store._selfcheck._fits import MemoryLogger
from lightning_store.metrics._reads import _stores_states_on_cpu


def _flag_trainer(**kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", StoreOnCPUDeprecationWarning)
        return Trainer(move_metrics_to_cpu=True, **kwargs)


def _tensor_results(trainer):
    return [(key, result) for key, result in all_results(trainer) if result.is_tensor]


def _assert_all_stored_on_cpu(trainer, count):
    results = _tensor_results(trainer)
    assert len(results) == count
    for key, result in results:
        assert isinstance(result, _StoredOnCPU), key
        assert all(t.device.type == "cpu" for t in stored_tensors(result)), key


@pytest.mark.parametrize("explicit_batch_size", [False, True], ids=["inferred_batch_size", "explicit_batch_size"])
def test_a_module_without_the_mixin_logs_lightnings_values_bit_for_bit_stored_on_the_cpu(
    explicit_batch_size, quiet_trainer_kwargs, recwarn
):
    kwargs = {**quiet_trainer_kwargs, "callbacks": [LoggingCallback()]}
    torch.manual_seed(0)
    _, plain = run_everything(PlainLoggingModel(explicit_batch_size=explicit_batch_size), kwargs)
    torch.manual_seed(0)
    model = PlainLoggingModel(explicit_batch_size=explicit_batch_size)
    with pytest.warns(StoreOnCPUDeprecationWarning):
        trainer, flagged = run_everything(model, kwargs, Trainer, move_metrics_to_cpu=True)
    for what in plain:
        assert plain[what], what
        assert_same(plain[what], flagged[what])
    assert type(model) is PlainLoggingModel
    # every call, from the module and from the callback, in every loop and for both dataloaders, kept on the CPU
    assert {
        "training_step.train_sum_11",
        "on_train_batch_end.cb_train_batch",
        "validation_step.val_min_10.1",
        "on_validation_batch_end.cb_val_batch.0",
        "test_step.test_num_max_01.0",
        "on_test_batch_end.cb_test_batch.1",
    } <= model.checked_keys
    # 25 keys a loop and dataloader; the callback's: 2 in training, 1 a loader and 1 at the epoch's end in each
    # validation loop (fit's, validate's), 1 a loader in test
    _assert_all_stored_on_cpu(trainer, 25 + 2 + 2 * (2 * (25 + 1) + 1) + 2 * (25 + 1))
    assert not [w for w in recwarn if issubclass(w.category, StoreOnCPUWarning)]


class _Manual(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.automatic_optimization = False
        self.layer = torch.nn.Linear(3, 1)

    def training_step(self, batch, batch_idx):
        optimizer = self.optimizers()
        loss = self.layer(batch[0]).pow(2).mean()
        optimizer.zero_grad()
        self.manual_backward(loss)
        optimizer.step()
        self.log("loss", loss, on_step=True, on_epoch=True, prog_bar=True)
        self.log_dict({"peak": loss, "weight": self.layer.weight.sum()}, reduce_fx="max")
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit_recorded(trainer_factory, model, trainer_kwargs, epochs=2, **fit_kwargs):
    torch.manual_seed(0)
    recorder = MemoryLogger()
    trainer = trainer_factory(**{**trainer_kwargs, "logger": recorder}, max_epochs=epochs, log_every_n_steps=1)
    trainer.fit(model, loader(), **fit_kwargs)
    return trainer, {
        "callback": dict(trainer.callback_metrics),
        "history": {f"{n}:{step}:{k}": v for n, (step, d) in enumerate(recorder.history) for k, v in d.items()},
    }


def test_manual_optimization_and_log_dict(quiet_trainer_kwargs):
    torch.manual_seed(0)
    _, plain = _fit_recorded(pl.Trainer, _Manual(), quiet_trainer_kwargs)
    torch.manual_seed(0)
    trainer, flagged = _fit_recorded(_flag_trainer, _Manual(), quiet_trainer_kwargs)
    assert_same(plain["callback"], flagged["callback"])
    assert_same(plain["history"], flagged["history"])
    _assert_all_stored_on_cpu(trainer, 3)


def test_the_module_stays_the_users_and_a_plain_trainer_fits_it_as_usual(quiet_trainer_kwargs):
    model = PlainLoggingModel()
    trainer = _flag_trainer(**quiet_trainer_kwargs, max_epochs=1)
    trainer.fit(model, loader())
    assert type(model) is PlainLoggingModel and "log" not in vars(model)
    for clone in (pickle.loads(pickle.dumps(model)), copy.deepcopy(model)):
        assert type(clone) is PlainLoggingModel
        assert torch.equal(clone.layer.weight, model.layer.weight)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    assert type(torch.load(buffer, weights_only=False)) is PlainLoggingModel
    # the flag belongs to the Trainer it was given to: another Trainer stores as Lightning does
    plain = pl.Trainer(**quiet_trainer_kwargs, max_epochs=1)
    plain.fit(model, loader())
    assert not [key for key, result in _tensor_results(plain) if isinstance(result, _StoredOnCPU)]
    assert type(plain.fit_loop.epoch_loop._results) is type(pl.Trainer().fit_loop.epoch_loop._results)


def test_without_the_flag_nothing_is_installed(quiet_trainer_kwargs):
    trainer = Trainer(move_metrics_to_cpu=False, **quiet_trainer_kwargs, max_epochs=1)
    assert [type(c).__name__ for c in trainer.callbacks] == [
        type(c).__name__ for c in pl.Trainer(**quiet_trainer_kwargs).callbacks
    ]
    trainer.fit(PlainLoggingModel(), loader())
    assert not any(isinstance(results, _StoringResults) for results in _collection._loop_results(trainer).values())


def test_a_fitted_trainer_pickles_and_stores_on_after_loading(quiet_trainer_kwargs, monkeypatch):
    trainer = _flag_trainer(**quiet_trainer_kwargs, max_epochs=1)
    trainer.fit(PlainLoggingModel(), loader())
    monkeypatch.setattr(_compat, "_made", {})  # as in a fresh process: the classes are made again on load
    loaded = pickle.loads(pickle.dumps(trainer))
    assert_same(dict(trainer.callback_metrics), dict(loaded.callback_metrics))
    results, reloaded = trainer.fit_loop.epoch_loop._results, loaded.fit_loop.epoch_loop._results
    assert isinstance(reloaded, _StoringResults) and reloaded._move_metrics_to_cpu is True
    assert list(reloaded) == list(results) and reloaded.training == results.training
    for key, result in results.items():
        assert isinstance(reloaded[key], _StoredOnCPU) and torch.equal(reloaded[key].value, result.value), key


def test_checkpoints_resume_and_load_as_in_plain_lightning(tmp_path, quiet_trainer_kwargs):
    def fit_then_resume(factory, root):
        kwargs = {**quiet_trainer_kwargs, "default_root_dir": root, "enable_checkpointing": True}
        checkpoint = ModelCheckpoint(dirpath=root, monitor="train_loss", save_last=True)
        torch.manual_seed(0)
        model = PlainLoggingModel()
        first = factory(**kwargs, max_epochs=1, callbacks=[checkpoint])
        first.fit(model, loader())
        _, seen = _fit_recorded(
            lambda **k: factory(**k, callbacks=[ModelCheckpoint(dirpath=root, monitor="train_loss")]),
            PlainLoggingModel(),
            kwargs,
            epochs=2,
            ckpt_path=checkpoint.last_model_path,
        )
        return checkpoint, seen

    plain_checkpoint, plain = fit_then_resume(pl.Trainer, tmp_path / "plain")
    checkpoint, flagged = fit_then_resume(_flag_trainer, tmp_path / "flag")
    assert_same(plain["callback"], flagged["callback"])
    assert_same(plain["history"], flagged["history"])
    assert checkpoint.best_model_score == plain_checkpoint.best_model_score
    saved = torch.load(checkpoint.last_model_path, weights_only=False)
    assert sorted(saved["callbacks"]) == sorted(
        torch.load(plain_checkpoint.last_model_path, weights_only=False)["callbacks"]
    )
    loaded = PlainLoggingModel.load_from_checkpoint(checkpoint.last_model_path)
    assert type(loaded) is PlainLoggingModel


class _Scriptable(pl.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layer = torch.nn.Linear(3, 1)
        self.auroc = BinaryAUROC(thresholds=None)

    def forward(self, x):
        return self.layer(x)

    def training_step(self, batch, batch_idx):
        scores = self(batch[0]).squeeze(1)
        self.auroc.update(scores.sigmoid(), (batch[0][:, 0] > 0).long())
        self.log("loss", scores.pow(2).mean())
        return scores.pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_model_summary_and_to_torchscript_are_those_of_plain_lightning(quiet_trainer_kwargs):
    modules = {}
    for name, factory in (("plain", pl.Trainer), ("flag", _flag_trainer)):
        modules[name] = _Scriptable()
        factory(**quiet_trainer_kwargs, max_epochs=1).fit(modules[name], loader())
    plain, flagged = modules["plain"], modules["flag"]
    assert _stores_states_on_cpu(flagged.auroc) and not _stores_states_on_cpu(plain.auroc)
    assert str(ModelSummary(flagged, max_depth=-1)) == str(ModelSummary(plain, max_depth=-1))
    x = torch.randn(5, 3)
    assert torch.equal(flagged.to_torchscript()(x), plain.to_torchscript()(x))


# --- torchmetrics Metrics --------------------------------------------------------------------------------------


class _Ranked(Metric):
    """A Metric of the user's own class with a list state."""

    def __init__(self):
        super().__init__()
        self.add_state("seen", default=[], dist_reduce_fx="cat")

    def update(self, values):
        self.seen.append(values)

    def compute(self):
        return dim_zero_cat(self.seen).sum()


class _WithMetrics(pl.LightningModule):
    def __init__(self, opt_out=None):
        super().__init__()
        self.layer = torch.nn.Linear(3, 1)
        self.auroc = BinaryAUROC(thresholds=None)
        self.collection = MetricCollection([BinaryAveragePrecision(thresholds=None), MeanMetric()])
        self.spearman = MinMaxMetric(SpearmanCorrCoef())
        self.classwise = ClasswiseWrapper(CatMetric())
        self.mean = MeanMetric()  # no list state: left as it is
        self.own = _Ranked()
        if opt_out is not None:
            self.auroc.move_metrics_to_cpu = opt_out

    def training_step(self, batch, batch_idx):
        (x,) = batch
        scores = torch.sigmoid(self.layer(x)).squeeze(1)
        target = (x[:, 0] > 0).long()
        self.auroc(scores, target)
        self.log("auroc", self.auroc, on_step=False, on_epoch=True)
        self.collection.update(scores, target)
        self.spearman.update(scores, x[:, 1])
        self.classwise.update(scores)
        self.mean.update(scores)
        self.own.update(scores)
        return scores.sum()

    def on_train_epoch_end(self):
        values = self.collection.compute()
        self.log_dict({f"col_{k}": v for k, v in values.items()})
        self.log("spearman_max", self.spearman.compute()["max"])
        self.log("classwise", torch.stack(list(self.classwise.compute().values())).sum())
        self.log("mean", self.mean.compute())
        self.log("own", self.own.compute())
        for metric in (self.collection, self.spearman, self.classwise, self.mean, self.own):
            metric.reset()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_torchmetrics_metrics_keep_their_list_states_on_the_cpu_with_the_values_of_plain_ones(
    quiet_trainer_kwargs, caplog
):
    torch.manual_seed(0)
    _, plain = _fit_recorded(pl.Trainer, _WithMetrics(), quiet_trainer_kwargs)
    torch.manual_seed(0)
    model = _WithMetrics()
    with caplog.at_level(logging.INFO), pytest.warns(StoreOnCPUWarning) as record:
        _, flagged = _fit_recorded(_flag_trainer, model, quiet_trainer_kwargs)
    assert_same(plain["callback"], flagged["callback"])
    assert_same(plain["history"], flagged["history"])
    configured = {"auroc", "collection.BinaryAveragePrecision", "spearman._base_metric", "classwise.metric"}
    for name, metric in model.named_modules():
        assert _stores_states_on_cpu(metric) is (name in configured), name
    assert type(model) is _WithMetrics
    said = [r.getMessage() for r in caplog.records if "keeps the list states of" in r.getMessage()]
    assert said == [
        "`Trainer(move_metrics_to_cpu=True)` keeps the list states of `self.auroc` (BinaryAUROC),"
        ' `self.collection["BinaryAveragePrecision"]` (BinaryAveragePrecision), `self.spearman._base_metric`'
        " (SpearmanCorrCoef), `self.classwise.metric` (CatMetric) on the CPU, as"
        " `lightning_store.store_states_on_cpu` does. To keep one on its device, set `move_metrics_to_cpu = False`"
        " on it where it is made: at the end of your LightningModule's `__init__`, or, for a Metric you pass to a"
        " library's LightningModule (a `metrics=` argument, say), on that Metric before you pass it in:"
        " `self.auroc.move_metrics_to_cpu = False`."
    ]
    # the user's own Metric: left on its device, with one warning that names it, at its class
    own = [w for w in record if issubclass(w.category, StoreOnCPUWarning)]
    assert len(own) == 1
    assert str(own[0].message) == (
        "`Trainer(move_metrics_to_cpu=True)` leaves the list states of `self.own` (_Ranked) on its device: _Ranked"
        " is not a torchmetrics class, and only its author knows whether its `update` reads its list states, which"
        " would then be on the CPU. HINT: if its `update` only appends to them, configure it where it is made: at"
        " the end of your LightningModule's `__init__`, or, for a Metric you pass to a library's LightningModule"
        " (a `metrics=` argument, say), on that Metric before you pass it in:"
        " `lightning_store.store_states_on_cpu(self.own)`. To keep it on its device and silence this warning, set"
        " `self.own.move_metrics_to_cpu = False` there."
    )
    assert (own[0].filename, own[0].lineno) == (__file__, inspect.getsourcelines(_Ranked)[1])


def test_metrics_are_configured_once_and_said_once_over_fit_validate_and_test(quiet_trainer_kwargs, caplog):
    class Evaluated(_WithMetrics):
        def validation_step(self, batch, batch_idx):
            self.auroc.update(torch.sigmoid(self.layer(batch[0])).squeeze(1), (batch[0][:, 0] > 0).long())

        test_step = validation_step

    model = Evaluated()
    model.own.move_metrics_to_cpu = False  # silences its warning
    trainer = _flag_trainer(**quiet_trainer_kwargs, max_epochs=1)
    with caplog.at_level(logging.INFO), warnings.catch_warnings():
        warnings.simplefilter("error", StoreOnCPUWarning)
        trainer.fit(model, loader(), loader(seed=1))
        trainer.validate(model, loader(seed=2), verbose=False)
        trainer.test(model, loader(seed=3), verbose=False)
    assert len([r for r in caplog.records if "keeps the list states of" in r.getMessage()]) == 1
    assert _stores_states_on_cpu(model.auroc) and not _stores_states_on_cpu(model.own)


def test_a_metric_opted_out_stays_as_it_is(quiet_trainer_kwargs):
    model = _WithMetrics(opt_out=False)
    model.own.move_metrics_to_cpu = False
    model.collection.move_metrics_to_cpu = False  # a collection: every Metric in it
    with warnings.catch_warnings():
        warnings.simplefilter("error", StoreOnCPUWarning)
        _fit_recorded(_flag_trainer, model, quiet_trainer_kwargs, epochs=1)
    assert not _stores_states_on_cpu(model.auroc) and not _stores_states_on_cpu(model.own)
    assert not _stores_states_on_cpu(model.collection["BinaryAveragePrecision"])
    assert _stores_states_on_cpu(model.spearman._base_metric)


def test_an_opt_out_that_is_not_a_bool_is_refused(quiet_trainer_kwargs):
    model = _WithMetrics(opt_out="no")
    with pytest.raises(TypeError) as info:
        _fit_recorded(_flag_trainer, model, quiet_trainer_kwargs, epochs=1)
    assert str(info.value) == (
        "Expected self.auroc.move_metrics_to_cpu to be a bool, got 'no' (str). HINT: set"
        " `self.auroc.move_metrics_to_cpu = False` to keep it on its device under `Trainer(move_metrics_to_cpu=True)`,"
        " or leave the attribute out."
    )


def test_a_metric_with_a_dist_sync_fn_of_its_own_is_left_with_a_warning(quiet_trainer_kwargs):
    model = _WithMetrics()
    model.own.move_metrics_to_cpu = False
    model.auroc.dist_sync_fn = lambda *args, **kwargs: None
    with pytest.warns(StoreOnCPUWarning, match=r"leaves the list states of `self.auroc` \(BinaryAUROC\) on its"):
        _fit_recorded(_flag_trainer, model, quiet_trainer_kwargs, epochs=1)
    assert not _stores_states_on_cpu(model.auroc)


# --- hints a user can paste -----------------------------------------------------------------------------------


class _InContainers(pl.LightningModule):
    """Metrics of the user's own class in an ``nn.ModuleList`` and an ``nn.ModuleDict``, as chemprop keeps them."""

    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(3, 1)
        self.metrics = torch.nn.ModuleList([_Ranked()])
        self.by_stage = torch.nn.ModuleDict({"val": _Ranked()})

    def training_step(self, batch, batch_idx):
        scores = self.layer(batch[0]).squeeze(1)
        self.metrics[0].update(scores.detach())
        return scores.sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _snippets(message):
    """The code a message gives between backticks that calls or sets something on ``self``."""
    return [code for code in re.findall(r"`([^`]+)`", message) if "self." in code and ("(" in code or "=" in code)]


def test_the_hints_for_metrics_in_a_module_list_and_dict_are_python_that_runs(quiet_trainer_kwargs):
    model = _InContainers()
    with pytest.warns(StoreOnCPUWarning) as record:
        _fit_recorded(_flag_trainer, model, quiet_trainer_kwargs, epochs=1)
    messages = sorted(str(w.message) for w in record if issubclass(w.category, StoreOnCPUWarning))
    assert len(messages) == 2
    snippets = [_snippets(message) for message in messages]
    assert snippets == [
        [
            'lightning_store.store_states_on_cpu(self.by_stage["val"])',
            'self.by_stage["val"].move_metrics_to_cpu = False',
        ],
        ["lightning_store.store_states_on_cpu(self.metrics[0])", "self.metrics[0].move_metrics_to_cpu = False"],
    ]
    configured, opted_out = _InContainers(), _InContainers()
    for store, opt_out in snippets:
        exec(store, {"lightning_store": lightning_store, "self": configured})
        exec(opt_out, {"self": opted_out})
    assert _stores_states_on_cpu(configured.metrics[0]) and _stores_states_on_cpu(configured.by_stage["val"])
    assert opted_out.metrics[0].move_metrics_to_cpu is False and opted_out.by_stage["val"].move_metrics_to_cpu is False
    with warnings.catch_warnings():
        warnings.simplefilter("error", StoreOnCPUWarning)  # the hint silences the warning
        _fit_recorded(_flag_trainer, opted_out, quiet_trainer_kwargs, epochs=1)


def test_the_code_for_a_submodule_reaches_it():
    model = torch.nn.Module()
    model.layers = torch.nn.Sequential(torch.nn.ModuleDict({"a-b": torch.nn.Identity()}))
    model.add_module("not an identifier", torch.nn.ModuleList([torch.nn.Identity()]))
    for path, module in model.named_modules():
        code = _move_metrics._code_for(model, path)
        assert eval(code, {"self": model}) is module, code
    assert _move_metrics._code_for(model, "layers.0.a-b") == 'self.layers[0]["a-b"]'
    assert _move_metrics._code_for(model, "not an identifier.0") == 'self.get_submodule("not an identifier")[0]'


def test_a_library_class_is_warned_about_at_the_users_line(quiet_trainer_kwargs, tmp_path, monkeypatch):
    # a Metric class of an installed library (chemprop's, say), defined under a decorator
    library = tmp_path / "a_library"
    library.mkdir()
    (library / "__init__.py").write_text(
        "from torchmetrics import CatMetric\n\n"
        "def register(cls):\n    return cls\n\n"
        "@register\nclass LibraryMetric(CatMetric):\n    pass\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(_move_metrics, "_library_roots", lambda: {str(tmp_path.resolve())})
    from a_library import LibraryMetric

    model = _InContainers()
    model.metrics[0] = LibraryMetric()
    model.by_stage["val"].move_metrics_to_cpu = False
    trainer = _flag_trainer(**quiet_trainer_kwargs, max_epochs=1)
    with pytest.warns(StoreOnCPUWarning, match=r"`self\.metrics\[0\]` \(LibraryMetric\)") as record:
        line = inspect.currentframe().f_lineno + 1
        trainer.fit(model, loader())
    (warning,) = [w for w in record if issubclass(w.category, StoreOnCPUWarning)]
    assert (warning.filename, warning.lineno) == (__file__, line)
    assert "for a Metric you pass to a library's LightningModule (a `metrics=` argument, say)" in str(warning.message)


def test_a_dist_sync_fn_warning_points_at_the_users_line(quiet_trainer_kwargs):
    model = _WithMetrics()
    model.own.move_metrics_to_cpu = False
    model.auroc.dist_sync_fn = lambda *args, **kwargs: None
    trainer = _flag_trainer(**quiet_trainer_kwargs, max_epochs=1)
    with pytest.warns(StoreOnCPUWarning, match=r"dist_sync_fn=") as record:
        line = inspect.currentframe().f_lineno + 1
        trainer.fit(model, loader())
    (warning,) = [w for w in record if "dist_sync_fn=" in str(w.message)]
    assert (warning.filename, warning.lineno) == (__file__, line)
