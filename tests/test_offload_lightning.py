"""Offloaded Metrics in a Lightning fit: logged as the plain ones, bit for bit, checkpointed both ways, reported."""

import inspect
import warnings

import pytest
import pytorch_lightning as pl
import torch
from _metrics import flatten
from _support import assert_same
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics import MeanMetric, MetricCollection
from torchmetrics.classification import BinaryAccuracy, BinaryAUROC, BinaryPrecision, BinaryRecall

import lightning_store
from lightning_store import offload_to_cpu, storage_report
from lightning_store._selfcheck._fits import MemoryLogger
from lightning_store.metrics._reads import _is_offloaded, _queue_of


def _data(seed: int = 0) -> DataLoader:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(24, 4, generator=generator)
    y = (x.sum(dim=1) + torch.randn(24, generator=generator) > 0).long()
    return DataLoader(TensorDataset(x, y), batch_size=6)


class MetricsModel(pl.LightningModule):
    """Every way a Metric object is logged: on_step through ``forward``, on_epoch after ``update``, a collection."""

    def __init__(self, offload: bool | str = False):
        super().__init__()
        torch.manual_seed(0)
        self.layer = torch.nn.Linear(4, 1)
        self.auroc = BinaryAUROC(thresholds=None)
        self.step_mean = MeanMetric()
        self.scores = MetricCollection([BinaryAccuracy(), BinaryPrecision(), BinaryRecall()], prefix="val_")
        self.auroc.persistent(True)
        if offload:  # True: the default worker; or "thread", "process"
            for metric in (self.auroc, self.step_mean, self.scores):
                offload_to_cpu(metric, worker=offload if isinstance(offload, str) else "thread")
        self.reports: list = []

    def forward(self, x):
        return self.layer(x).squeeze(-1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, y.float())
        self.auroc.update(logits.sigmoid().detach(), y)
        self.step_mean(loss.detach())  # forward: the batch value, logged on the step
        self.log("auroc", self.auroc, on_step=False, on_epoch=True)
        self.log("step_mean", self.step_mean, on_step=True, on_epoch=True)
        return loss

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.reports.append(storage_report(self.trainer))

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.scores.update(self(x).sigmoid(), y)
        self.log_dict(self.scores)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)


def _states(metric) -> dict:
    return {name: getattr(metric, name) for name in metric._defaults}  # `metric_state` is torchmetrics >= 1.1


def _same_states(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b)
    for key in a:
        left, right = flatten(a[key]), flatten(b[key])
        assert len(left) == len(right) and all(
            x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(left, right, strict=True)
        )


def _trainer(tmp_path, **kwargs):
    defaults = {
        "accelerator": "cpu",
        "devices": 1,
        "max_epochs": 2,
        "logger": MemoryLogger(),
        "log_every_n_steps": 1,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "default_root_dir": tmp_path,
    }
    return pl.Trainer(**{**defaults, **kwargs})


def _fit(tmp_path, offload, **kwargs):
    model, trainer = MetricsModel(offload), _trainer(tmp_path, **kwargs)
    trainer.fit(model, _data(), _data(1))
    return model, trainer


WORKERS = pytest.mark.parametrize("worker", ["thread", "process"])


@WORKERS
def test_logged_values_are_the_plain_ones_bit_for_bit(tmp_path, worker):
    offloaded, trainer = _fit(tmp_path / "offloaded", offload=worker)
    _, plain = _fit(tmp_path / "plain", offload=False)
    assert_same(trainer.callback_metrics, plain.callback_metrics)
    assert len(trainer.logger.history) == len(plain.logger.history) > 8
    for (step, logged), (plain_step, plain_logged) in zip(trainer.logger.history, plain.logger.history, strict=True):
        assert step == plain_step
        assert_same(logged, plain_logged)
    assert offloaded.scores.compute_groups == {0: ["BinaryAccuracy", "BinaryPrecision", "BinaryRecall"]}
    assert all(_is_offloaded(m) for m in (offloaded.auroc, offloaded.step_mean, offloaded.scores))


def test_storage_report_shows_each_offloaded_metric(tmp_path):
    model, _ = _fit(tmp_path, offload=True, max_epochs=1)
    rows = {row.name: row for row in model.reports[-1]}
    auroc = rows["auroc"]
    assert (auroc.kind, auroc.offloaded, auroc.store_on_cpu, auroc.device) == ("BinaryAUROC", True, True, "cpu")
    assert auroc.bytes == 24 * (4 + 8)  # 24 float32 predictions and int64 targets, every update in
    assert 0 <= auroc.pending_updates <= _queue_of(model.auroc).max_pending
    assert auroc.waited_s == _queue_of(model.auroc).waited_s >= 0.0
    plain_rows = {row.name: row for row in _fit(tmp_path / "plain", offload=False, max_epochs=1)[0].reports[-1]}
    assert not plain_rows["auroc"].offloaded and plain_rows["auroc"].bytes == auroc.bytes


@WORKERS
def test_a_checkpoint_of_an_offloaded_module_loads_into_a_plain_one_and_back(tmp_path, worker):
    offloaded, trainer = _fit(tmp_path, offload=worker, max_epochs=1)
    for seed in range(3):  # after the fit, which reset it: queued when the checkpoint is saved
        offloaded.auroc.update(torch.rand(4, generator=torch.Generator().manual_seed(seed)), torch.tensor([0, 1, 1, 0]))
    path = tmp_path / "offloaded.ckpt"
    trainer.save_checkpoint(path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plain = MetricsModel.load_from_checkpoint(path, offload=False)
        again = MetricsModel.load_from_checkpoint(path, offload=worker)
    _same_states(_states(plain.auroc), _states(offloaded.auroc))
    assert len(plain.auroc.preds) == 3
    _same_states(_states(again.auroc), _states(plain.auroc))
    assert _is_offloaded(again.auroc) and again.auroc.preds[0].device.type == "cpu"
    plain_path = tmp_path / "plain.ckpt"
    torch.save({"state_dict": plain.state_dict()}, plain_path)
    back = MetricsModel(offload=worker)
    back.load_state_dict(torch.load(plain_path)["state_dict"])
    _same_states(_states(back.auroc), _states(plain.auroc))
    assert torch.equal(back.auroc.compute(), plain.auroc.compute())


@WORKERS
def test_validate_then_fit_gives_the_plain_values(tmp_path, worker):
    outcomes = []
    for offload in (worker, False):
        model, trainer = MetricsModel(offload), _trainer(tmp_path / str(offload), max_epochs=1)
        validated = trainer.validate(model, _data(1), verbose=False)
        try:
            trainer.fit(model, _data(), _data(1))
        except RuntimeError as error:  # Lightning 2.1: the plain Metric fails, reset in inference mode
            outcomes.append((validated, type(error), "inference tensor" in str(error)))
        else:
            outcomes.append((validated, dict(trainer.callback_metrics), None))
    (validated, fitted, why), (plain_validated, plain_fitted, plain_why) = outcomes
    assert validated == plain_validated and why == plain_why
    if why is None:
        assert_same(fitted, plain_fitted)
    else:
        assert fitted is plain_fitted is RuntimeError  # the same error as the plain Metric's


def test_the_1x_flag_leaves_an_offloaded_metric_as_it_is(tmp_path):
    model = MetricsModel(offload=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", lightning_store.StoreOnCPUDeprecationWarning)
        trainer = lightning_store.Trainer(
            move_metrics_to_cpu=True,
            **{"accelerator": "cpu", "devices": 1, "max_epochs": 1, "logger": False, "default_root_dir": tmp_path},
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
    trainer.fit(model, _data(), _data(1))
    _, plain = _fit(tmp_path / "plain", offload=False, max_epochs=1)
    assert type(model.auroc).__mro__[1].__name__ == "_OffloadedMetric"  # not configured a second time
    assert_same(trainer.callback_metrics, plain.callback_metrics)


def test_to_torchscript_scripts_a_module_holding_offloaded_metrics_as_a_plain_one():
    scripted = {}
    for offload in (True, False):
        model = MetricsModel(offload)
        model.auroc.update(torch.tensor([0.2, 0.9]), torch.tensor([0, 1]))  # queued when it is scripted
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # TorchScript's and Lightning's deprecations
            scripted[offload] = model.to_torchscript()
    x = torch.randn(3, 4)
    assert torch.equal(scripted[True](x), scripted[False](x))
    assert torch.equal(scripted[True].auroc.preds[0], scripted[False].auroc.preds[0])


@WORKERS
def test_a_metric_called_through_forward_is_said_once_to_run_in_the_caller(tmp_path, worker):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _fit(tmp_path, offload=worker)
    said = [w for w in caught if issubclass(w.category, lightning_store.StoreOnCPUWarning)]
    assert [str(w.message) for w in said] == [
        "An offloaded MeanMetric was called (its `forward`), which runs in the caller's thread, not in the offload"
        " worker: it returns the batch's value, so it waits for the updates queued before it and updates here, on"
        " the CPU. HINT: to keep its work off the step, call `metric.update(...)` in the step instead, and log the"
        " Metric object with `self.log(name, metric, on_step=False, on_epoch=True)`."
    ]
    lines, first = inspect.getsourcelines(MetricsModel.training_step)
    line = first + next(i for i, text in enumerate(lines) if "self.step_mean(loss.detach())" in text)
    assert (said[0].filename, said[0].lineno) == (__file__, line)
