import inspect
import math
import re
import warnings

import numpy as np
import pytest
import pytorch_lightning as pl
import torch
import torchmetrics
from _support import LoggingModel, all_results, assert_same, loader, run_everything, stored_tensors
from pytorch_lightning.callbacks import EarlyStopping, ModelCheckpoint
from pytorch_lightning.utilities.exceptions import MisconfigurationException

from lightning_store import StoreOnCPUMixin, StoreOnCPUWarning, StorePolicyError, offload_to_cpu, store_states_on_cpu
from lightning_store._logged.result import _StoredOnCPU
from lightning_store._selfcheck._fits import MemoryLogger
from lightning_store.metrics._reads import _stores_states_on_cpu

result_module = pytest.importorskip("pytorch_lightning.trainer.connectors.logger_connector.result")


def _run_everything(store_on_cpu, explicit_batch_size, trainer_kwargs):
    torch.manual_seed(0)
    model = LoggingModel(store_on_cpu=store_on_cpu, explicit_batch_size=explicit_batch_size)
    trainer, seen = run_everything(model, trainer_kwargs)
    return trainer, model, seen


@pytest.mark.parametrize("explicit_batch_size", [False, True], ids=["inferred_batch_size", "explicit_batch_size"])
def test_values_are_those_lightning_gives_bit_for_bit(explicit_batch_size, quiet_trainer_kwargs):
    _, _, on_device = _run_everything(False, explicit_batch_size, quiet_trainer_kwargs)
    trainer, model, on_cpu = _run_everything(True, explicit_batch_size, quiet_trainer_kwargs)
    for what in on_device:
        assert on_device[what], what
        assert_same(on_device[what], on_cpu[what])
    # the check after every call saw keys of every loop, every reduction, and both dataloaders
    assert {"training_step.train_sum_11", "validation_step.val_min_10.1", "test_step.test_num_max_01.0"} <= (
        model.checked_keys
    )
    tensor_results = [(key, result) for key, result in all_results(trainer) if result.is_tensor]
    assert len(tensor_results) == 25 + 3 * 2 * 25  # training (1 loader); fit validation, validate, test (2 each)
    for key, result in tensor_results:
        assert isinstance(result, _StoredOnCPU), key
        assert all(t.device.type == "cpu" for t in stored_tensors(result)), key


def test_store_on_cpu_false_keeps_lightning_storage(quiet_trainer_kwargs):
    trainer = pl.Trainer(**quiet_trainer_kwargs, max_epochs=1)
    trainer.fit(LoggingModel(store_on_cpu=False), loader())
    assert not any(isinstance(result, _StoredOnCPU) for _, result in all_results(trainer))


class _DefaultOnModule(LoggingModel):
    store_on_cpu_default = True


def test_module_default_applies_to_calls_without_store_on_cpu(quiet_trainer_kwargs):
    trainer = pl.Trainer(**quiet_trainer_kwargs, max_epochs=1)
    model = _DefaultOnModule(store_on_cpu=None)
    model.check_storage = False
    trainer.fit(model, loader())
    results = dict(trainer.fit_loop.epoch_loop._results)
    assert results and all(isinstance(result, _StoredOnCPU) for result in results.values())


def test_explicit_false_overrides_module_default(quiet_trainer_kwargs):
    trainer = pl.Trainer(**quiet_trainer_kwargs, max_epochs=1)
    trainer.fit(_DefaultOnModule(store_on_cpu=False), loader())
    assert not any(isinstance(result, _StoredOnCPU) for _, result in all_results(trainer))


class _OneKeyModel(StoreOnCPUMixin, pl.LightningModule):
    """Logs ``self.value_fn(batch, batch_idx)`` as ``"x"`` with ``self.log_kwargs``; trains a tiny layer."""

    def __init__(self, value_fn, **log_kwargs):
        super().__init__()
        self.layer = torch.nn.Linear(3, 1)
        self.value_fn = value_fn
        self.log_kwargs = log_kwargs

    def training_step(self, batch, batch_idx):
        self.log("x", self.value_fn(batch, batch_idx), **self.log_kwargs)
        return self.layer(batch[0]).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def _fit_one_key(trainer_kwargs, value_fn, **log_kwargs):
    trainer = pl.Trainer(**trainer_kwargs, max_epochs=1)
    trainer.fit(_OneKeyModel(value_fn, **log_kwargs), loader())
    return trainer


@pytest.mark.parametrize(
    ("bad", "type_name"),
    [("yes", "str"), (1, "int"), (0, "int"), (torch.tensor(True), "torch.Tensor"), (1.0, "float")],
)
def test_store_on_cpu_must_be_bool_or_none(bad, type_name, quiet_trainer_kwargs):
    expected = f"Expected store_on_cpu to be a bool or None, got {bad!r} ({type_name})."
    with pytest.raises(TypeError, match=re.escape(expected)):
        _fit_one_key(quiet_trainer_kwargs, lambda b, i: 1.0, store_on_cpu=bad)


def test_numpy_bools_are_taken_for_store_on_cpu_and_the_module_default(quiet_trainer_kwargs):
    trainer = _fit_one_key(quiet_trainer_kwargs, lambda b, i: 1.0, store_on_cpu=np.True_)
    assert isinstance(trainer.fit_loop.epoch_loop._results["training_step.x"], _StoredOnCPU)

    class Model(_OneKeyModel):
        store_on_cpu_default = np.True_

    trainer = pl.Trainer(**quiet_trainer_kwargs, max_epochs=1)
    trainer.fit(Model(lambda b, i: 1.0), loader())
    assert isinstance(trainer.fit_loop.epoch_loop._results["training_step.x"], _StoredOnCPU)


def test_the_mixin_after_the_lightning_module_is_refused_when_the_class_is_defined():
    with pytest.raises(TypeError) as info:

        class Wrong(pl.LightningModule, StoreOnCPUMixin):
            pass

    assert str(info.value) == (
        "`Wrong` puts `LightningModule` before `StoreOnCPUMixin` in its bases, so `LightningModule.log` would run"
        " instead of the mixin's and refuse `store_on_cpu`."
        " HINT: put the mixin first: `class Wrong(StoreOnCPUMixin, LightningModule)`."
    )

    class Right(StoreOnCPUMixin, pl.LightningModule):
        def log(self, *args, **kwargs):  # an override of the user's own comes first, as it should
            super().log(*args, **kwargs)

    class Sub(Right):
        pass

    assert Sub.__mro__.index(StoreOnCPUMixin) < Sub.__mro__.index(pl.LightningModule)


def test_log_dict_store_on_cpu_must_be_bool_or_none(quiet_trainer_kwargs):
    class Model(_OneKeyModel):
        def training_step(self, batch, batch_idx):
            self.log_dict({"a": 1.0}, store_on_cpu="no")
            return self.layer(batch[0]).sum()

    trainer = pl.Trainer(**quiet_trainer_kwargs, max_epochs=1)
    with pytest.raises(TypeError, match=r"Expected store_on_cpu to be a bool or None, got 'no' \(str\)"):
        trainer.fit(Model(None), loader())


def test_module_default_must_be_bool_or_none(quiet_trainer_kwargs):
    class Model(_OneKeyModel):
        store_on_cpu_default = "always"

    trainer = pl.Trainer(**quiet_trainer_kwargs, max_epochs=1)
    with pytest.raises(TypeError, match=r"Expected Model.store_on_cpu_default to be a bool or None, got 'always'"):
        trainer.fit(Model(lambda b, i: 1.0), loader())


def test_same_key_with_two_policies_is_an_error(quiet_trainer_kwargs):
    class Model(_OneKeyModel):
        def training_step(self, batch, batch_idx):
            self.log("loss", 1.0, store_on_cpu=True)
            self.log("loss", 2.0, store_on_cpu=False)
            return self.layer(batch[0]).sum()

    trainer = pl.Trainer(**quiet_trainer_kwargs, max_epochs=1)
    with pytest.raises(
        StorePolicyError,
        match=r"You called `self.log\('loss', ..., store_on_cpu=False\)` in `training_step` but 'loss' was logged"
        r" there before with store_on_cpu=True",
    ):
        trainer.fit(Model(None), loader())


def test_enable_graph_stores_a_detached_cpu_copy(quiet_trainer_kwargs):
    """Lightning 2.x detaches every logged tensor, so no graph is kept on either storage."""

    class Model(_OneKeyModel):
        def training_step(self, batch, batch_idx):
            loss = self.layer(batch[0]).sum()
            self.log("graph", loss, enable_graph=True, on_step=True, on_epoch=True, store_on_cpu=self.store)
            result = self.trainer._results["training_step.graph"]
            self.seen.append((result._forward_cache, result.value))
            return loss

    def fit(store_on_cpu):
        torch.manual_seed(0)
        model = Model(None)
        model.store, model.seen = store_on_cpu, []
        trainer = pl.Trainer(**quiet_trainer_kwargs, max_epochs=1)
        trainer.fit(model, loader())
        return trainer, model.seen

    plain, plain_seen = fit(False)
    stored, stored_seen = fit(True)
    assert isinstance(stored.fit_loop.epoch_loop._results["training_step.graph"], _StoredOnCPU)
    assert_same(dict(plain.callback_metrics), dict(stored.callback_metrics))
    for step_value, value in plain_seen + stored_seen:
        assert step_value.grad_fn is None and value.grad_fn is None


class _MetricModel(StoreOnCPUMixin, pl.LightningModule):
    def __init__(self, **log_kwargs):
        super().__init__()
        self.layer = torch.nn.Linear(3, 1)
        self.metric = torchmetrics.SumMetric()
        self.log_kwargs = log_kwargs

    def training_step(self, batch, batch_idx):
        self.metric(batch[0].sum())
        self.log("metric", self.metric, on_step=False, on_epoch=True, **self.log_kwargs)
        return self.layer(batch[0]).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def test_metric_with_store_on_cpu_warns_and_is_logged_as_usual(quiet_trainer_kwargs):
    trainer = pl.Trainer(**quiet_trainer_kwargs, max_epochs=1)
    model = _MetricModel(store_on_cpu=True)
    with pytest.warns(StoreOnCPUWarning) as record:
        trainer.fit(model, loader())
    messages = [str(w.message) for w in record if issubclass(w.category, StoreOnCPUWarning)]
    assert len(messages) == 1  # once per key, although logged every step
    assert [w.filename for w in record if issubclass(w.category, StoreOnCPUWarning)] == [__file__]
    assert messages[0].startswith(
        "`self.log('metric', <SumMetric>, store_on_cpu=True)`: a `torchmetrics.Metric` keeps its state on its own"
        " device, so it is logged as usual and not moved."
    )
    assert "compute()" not in messages[0] and "offload_to_cpu(" not in messages[0]  # neither keeps the logged values
    result = trainer.fit_loop.epoch_loop._results["training_step.metric"]
    assert not isinstance(result, _StoredOnCPU) and result.value is model.metric
    plain = pl.Trainer(**quiet_trainer_kwargs, max_epochs=1)
    plain.fit(_MetricModel(), loader())
    assert torch.equal(trainer.callback_metrics["metric"], plain.callback_metrics["metric"])


_METRIC_WARNING = (
    "`self.log('metric', <{name}>, store_on_cpu=True)`: a `torchmetrics.Metric` keeps its state on its own device,"
    " so it is logged as usual and not moved. Moving it would break its next `update` (its inputs are on the"
    " device) and its sync across processes (NCCL refuses CPU tensors)."
)
_LEAVE_IT = (
    "log it without `store_on_cpu`; or set `store_on_cpu_default = True` on the LightningModule, which stores every"
    " tensor it logs on the CPU and logs its Metrics as usual, and leave `store_on_cpu` out of this call."
)


class _ClassifierModel(StoreOnCPUMixin, pl.LightningModule):
    """Logs a binary classification Metric (``make()``, configured by ``configure``) and a loss, on step and epoch."""

    def __init__(self, make, configure=None, **log_kwargs):
        super().__init__()
        torch.manual_seed(0)
        self.layer = torch.nn.Linear(3, 1)
        self.metric = make() if configure is None else configure(make())
        self.log_kwargs = log_kwargs

    def training_step(self, batch, batch_idx):
        x = batch[0]
        logits = self.layer(x).squeeze(-1)
        target = (x[:, 0] > 0).long()
        if isinstance(self.metric, torchmetrics.classification.BinaryAccuracy):
            self.metric(logits.detach().sigmoid(), target)  # the batch value, logged on step
            self.log("metric", self.metric, on_step=True, on_epoch=True, **self.log_kwargs)
        else:
            self.metric.update(logits.detach().sigmoid(), target)
            self.log("metric", self.metric, on_step=False, on_epoch=True, **self.log_kwargs)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, target.float())
        self.log("loss", loss, on_step=True, on_epoch=True, **self.log_kwargs)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class _ClassifierModelWithDefault(_ClassifierModel):
    store_on_cpu_default = True


def _logged(model, trainer_kwargs):
    """What ``model`` logs in a 2-epoch fit (every step's values handed to the logger, then callback_metrics), and
    the messages of the StoreOnCPUWarnings raised."""
    recorder = MemoryLogger()
    trainer = pl.Trainer(**{**trainer_kwargs, "logger": recorder}, max_epochs=2, log_every_n_steps=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, loader(n=24))
    messages = [str(w.message) for w in caught if issubclass(w.category, StoreOnCPUWarning)]
    return recorder.history, dict(trainer.callback_metrics), messages


def _assert_logs_as_plain_lightning(logged, plain):
    history, callback_metrics, messages = logged
    assert [step for step, _ in history] == [step for step, _ in plain[0]]
    for (_, values), (_, plain_values) in zip(history, plain[0], strict=True):
        assert_same(values, plain_values)
    assert_same(callback_metrics, plain[1])
    assert messages == []


def test_the_hint_for_a_metric_without_list_states_is_to_log_it_as_it_is(quiet_trainer_kwargs):
    accuracy = torchmetrics.classification.BinaryAccuracy
    plain = _logged(_ClassifierModel(accuracy), quiet_trainer_kwargs)
    *_, messages = _logged(_ClassifierModel(accuracy, store_on_cpu=True), quiet_trainer_kwargs)
    assert messages == [
        _METRIC_WARNING.format(name="BinaryAccuracy")
        + " BinaryAccuracy keeps no list state (only tensors that do not grow over an epoch): there is nothing to"
        " move. HINT: " + _LEAVE_IT
    ]
    # the hint, followed: without `store_on_cpu`, or under `store_on_cpu_default` (the loss stored on the CPU)
    _assert_logs_as_plain_lightning(_logged(_ClassifierModel(accuracy, store_on_cpu=None), quiet_trainer_kwargs), plain)
    _assert_logs_as_plain_lightning(_logged(_ClassifierModelWithDefault(accuracy), quiet_trainer_kwargs), plain)


def test_the_hint_for_a_metric_with_list_states_on_its_device_is_store_states_on_cpu(quiet_trainer_kwargs):
    def auroc():
        return torchmetrics.classification.BinaryAUROC(thresholds=None)

    plain = _logged(_ClassifierModel(auroc), quiet_trainer_kwargs)
    *_, messages = _logged(_ClassifierModel(auroc, store_on_cpu=True), quiet_trainer_kwargs)
    assert messages == [
        _METRIC_WARNING.format(name="BinaryAUROC")
        + " BinaryAUROC keeps what it gathers over an epoch (every prediction and target) in list states, on its"
        " device. HINT: to keep them on the CPU, configure the Metric once where it is made,"
        " `lightning_store.store_states_on_cpu(metric)`, and log it without `store_on_cpu`. To leave it on its"
        " device: " + _LEAVE_IT
    ]
    # the hint, followed: the Metric configured and logged without `store_on_cpu`; or left as it is
    configured = _ClassifierModel(auroc, store_states_on_cpu, store_on_cpu=None)
    _assert_logs_as_plain_lightning(_logged(configured, quiet_trainer_kwargs), plain)
    assert _stores_states_on_cpu(configured.metric)
    _assert_logs_as_plain_lightning(_logged(_ClassifierModel(auroc, store_on_cpu=None), quiet_trainer_kwargs), plain)
    # under `store_on_cpu_default`, the values are plain Lightning's, and it is said once that the states stay
    history, callback_metrics, messages = _logged(_ClassifierModelWithDefault(auroc), quiet_trainer_kwargs)
    _assert_logs_as_plain_lightning((history, callback_metrics, []), plain)
    assert messages == [_DEFAULT_WARNING.format(module="_ClassifierModelWithDefault", name="BinaryAUROC")]
    configured = _ClassifierModelWithDefault(auroc, store_states_on_cpu)  # the hint, followed: nothing to say
    _assert_logs_as_plain_lightning(_logged(configured, quiet_trainer_kwargs), plain)


_DEFAULT_WARNING = (
    "`{module}.store_on_cpu_default = True` stores on the CPU the tensors the module logs, not the states of the"
    " Metrics it logs: those stay where the Metric updates. {name} keeps what it gathers over an epoch (every"
    " prediction and target) in list states. HINT: to keep them on the CPU, configure the Metric once where it is"
    " made, `lightning_store.store_states_on_cpu(metric)`; then it is logged as before."
)


class _LogsOnlyMetrics(StoreOnCPUMixin, pl.LightningModule):
    """As chemprop's module: every value it logs is a Metric object, through ``self.log`` or ``self.log_dict``."""

    store_on_cpu_default = True

    def __init__(self, via_log_dict):
        super().__init__()
        self.layer = torch.nn.Linear(3, 1)
        self.auroc = torchmetrics.classification.BinaryAUROC(thresholds=None)
        self.via_log_dict = via_log_dict

    def training_step(self, batch, batch_idx):
        logits = self.layer(batch[0]).squeeze(-1)
        self.auroc.update(logits.detach().sigmoid(), (batch[0][:, 0] > 0).long())
        if self.via_log_dict:
            self.line = inspect.currentframe().f_lineno + 1
            self.log_dict({"auroc": self.auroc}, on_step=False, on_epoch=True)
        else:
            self.line = inspect.currentframe().f_lineno + 1
            self.log("auroc", self.auroc, on_step=False, on_epoch=True)
        return logits.sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.parametrize("via_log_dict", [False, True], ids=["log", "log_dict"])
def test_store_on_cpu_default_says_once_at_the_users_line_that_a_metrics_states_stay(
    quiet_trainer_kwargs, via_log_dict
):
    model = _LogsOnlyMetrics(via_log_dict)
    trainer = pl.Trainer(**quiet_trainer_kwargs, max_epochs=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, loader(n=24))
    said = [w for w in caught if issubclass(w.category, StoreOnCPUWarning)]
    assert [str(w.message) for w in said] == [_DEFAULT_WARNING.format(module="_LogsOnlyMetrics", name="BinaryAUROC")]
    assert (said[0].filename, said[0].lineno) == (__file__, model.line)


@pytest.mark.parametrize(
    ("configure", "hint"),
    [
        (store_states_on_cpu, "its list states are on the CPU already (`store_states_on_cpu`)"),
        (offload_to_cpu, "its states are on the CPU already (`offload_to_cpu`)"),
    ],
    ids=["store_states_on_cpu", "offload_to_cpu"],
)
def test_the_hint_for_a_metric_on_the_cpu_already_is_to_log_it_as_it_is(configure, hint, quiet_trainer_kwargs):
    def auroc():
        return torchmetrics.classification.BinaryAUROC(thresholds=None)

    plain = _logged(_ClassifierModel(auroc), quiet_trainer_kwargs)
    *_, messages = _logged(_ClassifierModel(auroc, configure, store_on_cpu=True), quiet_trainer_kwargs)
    assert messages == [_METRIC_WARNING.format(name="BinaryAUROC") + f" HINT: {hint}: " + _LEAVE_IT]
    # the hint, followed
    _assert_logs_as_plain_lightning(
        _logged(_ClassifierModel(auroc, configure, store_on_cpu=None), quiet_trainer_kwargs), plain
    )
    _assert_logs_as_plain_lightning(_logged(_ClassifierModelWithDefault(auroc, configure), quiet_trainer_kwargs), plain)


def test_metric_under_module_default_gets_no_warning(quiet_trainer_kwargs, recwarn):
    class Model(_MetricModel):
        store_on_cpu_default = True

    trainer = pl.Trainer(**quiet_trainer_kwargs, max_epochs=1)
    trainer.fit(Model(), loader())
    assert not [w for w in recwarn if issubclass(w.category, StoreOnCPUWarning)]
    assert "metric" in trainer.callback_metrics


def test_log_dict_applies_store_on_cpu_to_every_value(quiet_trainer_kwargs):
    class Model(_OneKeyModel):
        def training_step(self, batch, batch_idx):
            self.log_dict({"a": batch[0].sum(), "b": 2.0}, store_on_cpu=True, on_epoch=True)
            self.log("c", 3.0)
            return self.layer(batch[0]).sum()

    trainer = pl.Trainer(**quiet_trainer_kwargs, max_epochs=1)
    trainer.fit(Model(None), loader())
    results = trainer.fit_loop.epoch_loop._results
    assert isinstance(results["training_step.a"], _StoredOnCPU)
    assert isinstance(results["training_step.b"], _StoredOnCPU)
    assert not isinstance(results["training_step.c"], _StoredOnCPU)
    assert trainer.callback_metrics["b_epoch"].item() == 2.0


def test_log_dict_metric_collection_warns_per_metric(quiet_trainer_kwargs):
    class Model(_OneKeyModel):
        def __init__(self):
            super().__init__(None)
            self.metrics = torchmetrics.MetricCollection({"s": torchmetrics.SumMetric(), "m": torchmetrics.MaxMetric()})

        def training_step(self, batch, batch_idx):
            self.metrics(batch[0].sum())
            self.log_dict(self.metrics, store_on_cpu=True)
            return self.layer(batch[0]).sum()

    trainer = pl.Trainer(**quiet_trainer_kwargs, max_epochs=1)
    with pytest.warns(StoreOnCPUWarning) as record:
        trainer.fit(Model(), loader())
    warned = sorted(str(w.message).split("'")[1] for w in record if issubclass(w.category, StoreOnCPUWarning))
    assert warned == ["m", "s"]


def test_log_dict_metric_warning_names_log_dict_and_points_at_its_line(quiet_trainer_kwargs):
    class Model(_MetricModel):
        def training_step(self, batch, batch_idx):
            self.metric(batch[0].sum())
            self.log_dict({"loss": 1.0, "metric": self.metric}, store_on_cpu=True)  # the line warned about
            return self.layer(batch[0]).sum()

    line = Model.training_step.__code__.co_firstlineno + 2
    trainer = pl.Trainer(**quiet_trainer_kwargs, max_epochs=1)
    with pytest.warns(StoreOnCPUWarning) as record:
        trainer.fit(Model(), loader())
    [warning] = [w for w in record if issubclass(w.category, StoreOnCPUWarning)]
    assert (warning.filename, warning.lineno) == (__file__, line)
    assert str(warning.message).startswith(
        "`self.log_dict({..., 'metric': <SumMetric>}, store_on_cpu=True)`: a `torchmetrics.Metric` keeps its state"
    )


def test_monitor_works_for_checkpoint_and_early_stopping(tmp_path, quiet_trainer_kwargs):
    def fit(store_on_cpu):
        torch.manual_seed(0)
        checkpoint = ModelCheckpoint(dirpath=tmp_path / str(store_on_cpu), monitor="val_loss", mode="min")
        stopping = EarlyStopping(monitor="val_mean_01", mode="max", patience=1, min_delta=10.0)
        kwargs = {**quiet_trainer_kwargs, "enable_checkpointing": True}
        trainer = pl.Trainer(**kwargs, max_epochs=6, callbacks=[checkpoint, stopping])
        trainer.fit(LoggingModel(store_on_cpu=store_on_cpu), loader(), loader(seed=1))
        return trainer, checkpoint, stopping

    trainer_a, checkpoint_a, stopping_a = fit(False)
    trainer_b, checkpoint_b, stopping_b = fit(True)
    assert checkpoint_b.best_model_score is not None
    assert checkpoint_b.best_model_score.device.type == "cpu"
    assert torch.equal(checkpoint_a.best_model_score, checkpoint_b.best_model_score)
    assert stopping_b.stopped_epoch == stopping_a.stopped_epoch > 0
    assert trainer_b.current_epoch == trainer_a.current_epoch < 6


@pytest.mark.parametrize(
    ("value_fn", "expected"),
    [
        (lambda b, i: torch.tensor(float("nan")), math.nan),
        (lambda b, i: torch.tensor(float("inf")), math.inf),
        (lambda b, i: torch.tensor(-float("inf")), -math.inf),
        (lambda b, i: torch.tensor(i), 0.8),  # int tensor: mean of 0, 1, 2 weighted by 4, 4, 2
        (lambda b, i: torch.tensor(i % 2 == 0), 0.6),  # bool tensor
        (lambda b, i: torch.tensor(2.0, dtype=torch.float16), 2.0),
        (lambda b, i: torch.tensor(2.0, dtype=torch.float64), 2.0),
        (lambda b, i: torch.tensor([[3.0]], requires_grad=True) * 1, 3.0),  # one element, needs grad
    ],
    ids=["nan", "inf", "-inf", "int", "bool", "float16", "float64", "requires_grad"],
)
def test_special_values_are_stored_as_lightning_stores_them(value_fn, expected, quiet_trainer_kwargs):
    def fit(store_on_cpu):
        return _fit_one_key(quiet_trainer_kwargs, value_fn, on_step=False, on_epoch=True, store_on_cpu=store_on_cpu)

    plain, stored = fit(False), fit(True)
    assert_same(dict(plain.callback_metrics), dict(stored.callback_metrics))
    value = stored.callback_metrics["x"]
    assert value.grad_fn is None and value.device.type == "cpu"
    if math.isnan(expected):
        assert value.isnan()
    else:
        assert value.item() == pytest.approx(expected)


def test_int_tensor_keeps_lightnings_warning(quiet_trainer_kwargs):
    result_module.warning_cache.clear()
    with pytest.warns(UserWarning, match=r"You called `self.log\('x', ...\)` in your `training_step` but the value"):
        _fit_one_key(quiet_trainer_kwargs, lambda b, i: torch.tensor(i), store_on_cpu=True)


def test_non_scalar_tensor_keeps_lightnings_error(quiet_trainer_kwargs):
    with pytest.raises(ValueError, match="the tensor must have a single element"):
        _fit_one_key(quiet_trainer_kwargs, lambda b, i: torch.ones(2), store_on_cpu=True)


def test_logging_without_trainer_keeps_lightnings_warning():
    model = _OneKeyModel(None)
    with pytest.warns(UserWarning, match="the `self.trainer` reference is not registered"):
        model.log("x", 1.0, store_on_cpu=True)


def test_logging_from_predict_step_keeps_lightnings_error(quiet_trainer_kwargs):
    class Model(_OneKeyModel):
        def predict_step(self, batch, batch_idx):
            self.log("p", 1.0, store_on_cpu=True)

    trainer = pl.Trainer(**quiet_trainer_kwargs)
    with pytest.raises(MisconfigurationException, match="you are trying to log in a `predict` hook"):
        trainer.predict(Model(None), loader())


def test_rank_zero_only_and_sync_dist_keep_their_meaning(quiet_trainer_kwargs):
    class Model(_OneKeyModel):
        def training_step(self, batch, batch_idx):
            self.log("r", 1.0, rank_zero_only=True, sync_dist=True, store_on_cpu=True)
            self.log("s", 2.0, sync_dist=True, store_on_cpu=True)
            return self.layer(batch[0]).sum()

    trainer = pl.Trainer(**quiet_trainer_kwargs, max_epochs=1)
    trainer.fit(Model(None), loader())
    results = trainer.fit_loop.epoch_loop._results
    assert results["training_step.r"].meta.sync.rank_zero_only
    assert not results["training_step.r"]._sync_runs
    # one process: Lightning turns `sync_dist` off, and so it stays
    assert not results["training_step.s"]._sync_runs
    assert trainer.callback_metrics["s"].item() == 2.0


@pytest.fixture
def copies_land_late(monkeypatch):
    """Every value reaches the CPU through copies that land only when a read waits for them."""
    from _support import ManualTransfer

    from lightning_store._logged import result as _result

    transfer = ManualTransfer()
    monkeypatch.setattr(_result, "_transfer_for", lambda device: transfer)
    return transfer


def test_values_are_exact_when_copies_land_only_on_reads(copies_land_late, quiet_trainer_kwargs):
    _, _, on_device = _run_everything(False, False, quiet_trainer_kwargs)
    _, _, on_cpu = _run_everything(True, False, quiet_trainer_kwargs)
    for what in on_device:
        assert_same(on_device[what], on_cpu[what])
    assert len(copies_land_late.copies) > 500  # the path under test was taken, many times
    assert all(copy.waited and copy.released for copy in copies_land_late.copies)  # nothing left pending


def test_an_exception_that_ends_the_loop_leaves_nothing_pending(copies_land_late, quiet_trainer_kwargs):
    class Failing(LoggingModel):
        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            if batch_idx == 2:
                raise RuntimeError("step failed")
            return loss

    trainer = pl.Trainer(**quiet_trainer_kwargs, max_epochs=1)
    with pytest.raises(RuntimeError, match="step failed"):
        trainer.fit(Failing(store_on_cpu=True, check_storage=False), loader(n=20))
    assert copies_land_late.copies
    assert all(copy.waited and copy.released for copy in copies_land_late.copies)  # teardown drained them


class _CompiledNetModel(StoreOnCPUMixin, pl.LightningModule):
    """``torch.compile`` as Lightning documents it: the inner network compiled, ``training_step`` left to Python."""

    def __init__(self, net, store_on_cpu):
        super().__init__()
        self.net, self.store = net, store_on_cpu
        self.stored = []  # (class name, devices) of the key's stored result after each step

    def training_step(self, batch, batch_idx):
        (x,) = batch
        loss = self.net(x).pow(2).mean()
        self.log("loss", loss, on_step=True, on_epoch=True, store_on_cpu=self.store)
        result = self.trainer._results["training_step.loss"]
        self.stored.append((type(result).__name__, {t.device.type for t in stored_tensors(result)}))
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_a_compiled_inner_network_logs_the_values_of_plain_logging_stored_on_the_cpu(quiet_trainer_kwargs):
    net = torch.compile(torch.nn.Linear(3, 1))  # one compiled module for both fits: compiled once
    initial = {name: value.clone() for name, value in net.state_dict().items()}
    seen = {}
    for store in (False, True):
        net.load_state_dict(initial)
        model = _CompiledNetModel(net, store)
        recorder = MemoryLogger()
        trainer = pl.Trainer(**{**quiet_trainer_kwargs, "logger": recorder}, max_epochs=2, log_every_n_steps=1)
        trainer.fit(model, loader())
        seen[store] = (dict(trainer.callback_metrics), recorder.history, model.stored)
    assert_same(seen[True][0], seen[False][0])
    assert [step for step, _ in seen[True][1]] == [step for step, _ in seen[False][1]]
    for (_, stored), (_, plain) in zip(seen[True][1], seen[False][1], strict=True):
        assert_same(stored, plain)
    assert len(seen[True][2]) == 6  # 3 steps in each of 2 epochs
    assert all(name.startswith("_StoredOnCPU") and devices == {"cpu"} for name, devices in seen[True][2])
    assert all(not name.startswith("_StoredOnCPU") for name, _ in seen[False][2])
