import time
import warnings

import pytest
import pytorch_lightning as pl
import torch
import torchmetrics
from _support import loader

from lightning_store import (
    KeyStorage,
    StoreOnCPUDeprecationWarning,
    StoreOnCPUMixin,
    Trainer,
    format_storage_report,
    offload_to_cpu,
    storage_report,
    store_states_on_cpu,
)
from lightning_store.metrics._reads import _queue_of


class _ReportModel(StoreOnCPUMixin, pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(3, 1)
        self.metric = torchmetrics.MeanMetric()
        self.during_training: list[KeyStorage] = []

    def training_step(self, batch, batch_idx):
        loss = self.layer(batch[0]).pow(2).mean()
        self.metric(loss)
        self.log("loss", loss, store_on_cpu=True, on_step=True, on_epoch=True)
        self.log("peak", loss, reduce_fx="max", sync_dist=True)
        self.log("metric", self.metric)
        return loss

    def validation_step(self, batch, batch_idx, dataloader_idx=0):
        self.log("val_loss", self.layer(batch[0]).mean(), store_on_cpu=True)

    def on_train_epoch_end(self):
        self.during_training = storage_report(self.trainer)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def test_rows_describe_every_key_of_every_loop(quiet_trainer_kwargs):
    trainer = pl.Trainer(**quiet_trainer_kwargs, max_epochs=1)
    model = _ReportModel()
    trainer.fit(model, loader(), [loader(seed=1), loader(seed=2)])
    rows = {(row.loop, row.name, row.dataloader_idx): row for row in model.during_training}
    assert rows[("train", "loss", None)] == KeyStorage(
        loop="train",
        hook="training_step",
        name="loss",
        dataloader_idx=None,
        kind="tensor",
        store_on_cpu=True,
        set_by="store_on_cpu",
        device="cpu",
        bytes=4 + 8 + 4,
        reduce_fx="mean",
        sync_dist=False,
    )  # float32 value, int64 batch size, float32 step value; the epoch value is computed after the hook
    peak = rows[("train", "peak", None)]
    assert (peak.store_on_cpu, peak.set_by, peak.reduce_fx, peak.bytes, peak.sync_dist) == (False, "-", "max", 4, False)
    metric = rows[("train", "metric", None)]
    assert (metric.kind, metric.store_on_cpu, metric.set_by, metric.reduce_fx) == ("MeanMetric", False, "-", "compute")
    assert metric.bytes >= 8  # MeanMetric keeps a float32 mean value and weight, at least
    for idx in (0, 1):
        val = rows[("fit_validation", "val_loss", idx)]
        assert (val.hook, val.store_on_cpu, val.device) == ("validation_step", True, "cpu")
    assert len(rows) == 5


def test_no_rows_before_anything_is_logged():
    assert storage_report(pl.Trainer(logger=False)) == []


_ROWS = [
    KeyStorage("train", "training_step", "loss", None, "tensor", True, "store_on_cpu", "cpu", 20, "mean", False),
    KeyStorage("validate", "validation_step", "acc", 1, "Accuracy", False, "-", "cuda:0", 8, "compute", True),
    KeyStorage(
        *("train", "training_step", "auroc", None, "BinaryAUROC", True, "offload_to_cpu", "cpu", 8, "compute"),
        *(False, True, 3, 0.25, True),
    ),
]
_HEADER = [
    *("loop", "hook", "name", "dataloader_idx", "kind", "store_on_cpu", "set_by", "device", "bytes", "reduce_fx"),
    *("sync_dist", "offloaded", "pending_updates", "waited_s", "worker_behind"),
]


def test_the_table_has_a_header_and_a_line_per_row():
    lines = format_storage_report(_ROWS).splitlines()
    assert lines[0].split() == _HEADER
    assert lines[1].split() == [
        *("train", "training_step", "loss", "-", "tensor", "True", "store_on_cpu", "cpu", "20", "mean", "False"),
        *("False", "0", "0.000", "False"),
    ]
    assert lines[3].split()[-4:] == ["True", "3", "0.250", "True"]
    assert lines[2].split()[7] == "cuda:0"
    assert all(len(line.split()) == 15 for line in lines)


def test_a_width_leaves_out_the_silent_columns_first_then_the_least_telling_and_says_which():
    tensor_rows = _ROWS[:1]  # no dataloader, no sync, nothing offloaded
    assert format_storage_report(tensor_rows, width=200) == format_storage_report(tensor_rows)
    lines = format_storage_report(tensor_rows, width=80).splitlines()
    assert lines[:2] == [
        "loop   hook           name  kind    store_on_cpu  set_by        device  bytes",
        "train  training_step  loss  tensor  True          store_on_cpu  cpu     20",
    ]
    assert " ".join(lines[2:]) == (
        "(left out to fit the width: dataloader_idx, sync_dist, offloaded, pending_updates, worker_behind, waited_s,"
        " reduce_fx)"
    )
    lines = format_storage_report(_ROWS, width=60).splitlines()
    assert lines[0].split() == ["loop", "name", "kind", "set_by", "device", "bytes"]
    assert lines[1].split() == ["train", "loss", "tensor", "store_on_cpu", "cpu", "20"]
    assert max(len(line) for line in lines) <= 60
    assert " ".join(lines[4:]) == (
        "(left out to fit the width: dataloader_idx, reduce_fx, sync_dist, offloaded, waited_s, worker_behind,"
        " store_on_cpu, hook, pending_updates)"
    )


class _SetByModel(StoreOnCPUMixin, pl.LightningModule):
    """Logs a tensor with and without ``store_on_cpu`` and four AUROCs: plain, configured, offloaded, and one the
    flag configures; takes the report after each training step."""

    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(3, 1)
        self.plain = torchmetrics.classification.BinaryAUROC(thresholds=None)
        self.configured = store_states_on_cpu(torchmetrics.classification.BinaryAUROC(thresholds=None))
        self.offloaded = offload_to_cpu(torchmetrics.classification.BinaryAUROC(thresholds=None), worker="thread")
        self.by_flag = torchmetrics.classification.BinaryAUROC(thresholds=None)
        self.rows: list[KeyStorage] = []

    def training_step(self, batch, batch_idx):
        preds = torch.sigmoid(self.layer(batch[0])).squeeze(-1)
        target = (batch[0][:, 0] > 0).long()
        for name in ("plain", "configured", "offloaded", "by_flag"):
            getattr(self, name).update(preds.detach(), target)
            self.log(name, getattr(self, name), on_step=False, on_epoch=True)
        self.log("asked", preds.mean(), store_on_cpu=True)
        self.log("left_open", preds.sum())
        return preds.mean()

    def on_train_batch_end(self, *args):
        self.rows = storage_report(self.trainer)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


@pytest.mark.parametrize("flag", [False, True], ids=["no_flag", "flag"])
def test_set_by_tells_the_option_from_the_flag_and_says_nothing_for_what_was_given_neither(flag, quiet_trainer_kwargs):
    model = _SetByModel()
    model.plain.move_metrics_to_cpu = False  # the flag's opt-out: it stays as it is under the flag too
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", StoreOnCPUDeprecationWarning)
        trainer = Trainer(**quiet_trainer_kwargs, max_epochs=1, move_metrics_to_cpu=flag)
    trainer.fit(model, loader())
    rows = {row.name: (row.store_on_cpu, row.set_by, row.device) for row in model.rows}
    assert rows == {
        "plain": (False, "-", "cpu"),
        "configured": (True, "store_states_on_cpu", "cpu"),
        "offloaded": (True, "offload_to_cpu", "cpu"),
        "by_flag": (True, "flag", "cpu") if flag else (False, "-", "cpu"),
        "asked": (True, "store_on_cpu", "cpu"),
        "left_open": (True, "flag", "cpu") if flag else (False, "-", "cpu"),
    }


class _SlowSum(torchmetrics.Metric):
    """A sum whose update takes a while, so that updates are still queued when the report is taken."""

    def __init__(self):
        super().__init__()
        self.add_state("values", default=[], dist_reduce_fx="cat")

    def update(self, value):
        time.sleep(0.02)
        self.values.append(value)

    def compute(self):
        return torch.cat(self.values).sum()


class _OffloadedModel(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(3, 1)
        self.total = offload_to_cpu(_SlowSum(), worker="thread")
        self.pending_before: list[int] = []
        self.rows: list[KeyStorage] = []

    def training_step(self, batch, batch_idx):
        for _ in range(3):
            self.total.update(batch[0][:, 0].clone())
        self.log("total", self.total, on_step=False, on_epoch=True)
        return self.layer(batch[0]).sum()

    def on_train_batch_end(self, *args):
        self.pending_before.append(_queue_of(self.total).pending)
        self.rows.append(storage_report(self.trainer)[0])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def test_pending_updates_are_read_with_the_bytes(quiet_trainer_kwargs):
    model = _OffloadedModel()
    pl.Trainer(**quiet_trainer_kwargs, max_epochs=1).fit(model, loader(n=12, batch_size=4))
    assert any(model.pending_before)  # updates were queued when the report was asked for
    # every update queued before the report is in its bytes, and none is said to be pending
    assert [(row.pending_updates, row.bytes) for row in model.rows] == [(0, 3 * 4 * 4 * step) for step in (1, 2, 3)]


class _HookProbe(pl.Callback):
    def __init__(self):
        self.rows: dict[str, dict[str, tuple[str, int]]] = {}

    def _take(self, trainer, hook):
        self.rows[hook] = {row.name: (row.device, row.bytes) for row in storage_report(trainer)}

    def on_validation_batch_end(self, trainer, *args):
        self._take(trainer, "on_validation_batch_end")

    def on_validation_epoch_end(self, trainer, *args):
        self._take(trainer, "on_validation_epoch_end")

    def on_train_epoch_end(self, trainer, *args):
        self._take(trainer, "on_train_epoch_end")


class _ValidatedModel(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(3, 1)
        self.auroc = store_states_on_cpu(torchmetrics.classification.BinaryAUROC(thresholds=None))

    def training_step(self, batch, batch_idx):
        return self.layer(batch[0]).sum()

    def validation_step(self, batch, batch_idx):
        self.auroc.update(torch.sigmoid(self.layer(batch[0])).squeeze(-1), (batch[0][:, 0] > 0).long())
        self.log("val_auroc", self.auroc)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def test_a_validation_metric_is_reset_by_on_train_epoch_end_as_the_docstring_says(quiet_trainer_kwargs):
    probe = _HookProbe()
    trainer = pl.Trainer(**quiet_trainer_kwargs, max_epochs=1, num_sanity_val_steps=0, callbacks=[probe])
    trainer.fit(_ValidatedModel(), loader(), loader(n=8, seed=1))
    every_prediction = ("cpu", 8 * (4 + 8))  # float32 predictions and int64 targets
    assert probe.rows["on_validation_batch_end"]["val_auroc"] == every_prediction
    assert probe.rows["on_validation_epoch_end"]["val_auroc"][0] == "cpu"
    assert probe.rows["on_train_epoch_end"]["val_auroc"] == ("-", 0)


class _WrappedMetricModel(pl.LightningModule):
    """Logs a Metric made of two (``CompositionalMetric``), whose inner Metrics keep their states on the CPU."""

    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(3, 1)
        self.score = store_states_on_cpu(
            torchmetrics.classification.BinaryAUROC(thresholds=None)
            + torchmetrics.classification.BinaryAveragePrecision(thresholds=None)
        )
        self.rows: list[KeyStorage] = []
        self.shared = False

    def validation_step(self, batch, batch_idx):
        preds = torch.sigmoid(self.layer(batch[0])).squeeze(-1)
        self.score.update(preds, (batch[0][:, 0] > 0).long())
        self.log("score", self.score)
        self.rows = storage_report(self.trainer)
        self.shared = self.score.metric_a.preds[-1] is self.score.metric_b.preds[-1]


def test_a_logged_wrapper_shows_the_states_of_the_metrics_it_holds(quiet_trainer_kwargs):
    model = _WrappedMetricModel()
    pl.Trainer(**quiet_trainer_kwargs).validate(model, loader())
    (row,) = model.rows
    assert (row.kind, row.store_on_cpu, row.set_by, row.device) == (
        "CompositionalMetric",
        True,
        "store_states_on_cpu",
        "cpu",
    )
    # 10 float32 predictions and 10 int64 targets, counted once: both inner Metrics keep the same tensors
    assert row.bytes == 10 * 4 + 10 * 8
    assert model.shared


class _OneMetricForValidationAndTest(pl.LightningModule):
    """As chemprop's ``metrics[0]``: one Metric object logged by validation and by test."""

    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(3, 1)
        self.auroc = torchmetrics.classification.BinaryAUROC(thresholds=None)
        self.rows: dict[str, list] = {}

    def training_step(self, batch, batch_idx):
        return self.layer(batch[0]).sum()

    def validation_step(self, batch, batch_idx):
        self.auroc.update(torch.sigmoid(self.layer(batch[0])).squeeze(1), (batch[0][:, 0] > 0).long())
        self.log("auroc", self.auroc, on_step=False, on_epoch=True)

    test_step = validation_step

    def on_validation_batch_end(self, *args):
        self.rows.setdefault("validation", []).append(storage_report(self.trainer))

    def on_test_batch_end(self, *args):
        self.rows.setdefault("test", []).append(storage_report(self.trainer))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_a_metric_logged_by_two_loops_is_counted_in_the_loop_that_runs(quiet_trainer_kwargs):
    model = _OneMetricForValidationAndTest()
    trainer = pl.Trainer(**quiet_trainer_kwargs, max_epochs=1, num_sanity_val_steps=0)
    trainer.fit(model, loader(n=8), loader(n=8, seed=1))
    trainer.test(model, loader(n=12, seed=2), verbose=False)
    during_validation = {row.loop: row for row in model.rows["validation"][-1]}
    assert during_validation["fit_validation"].bytes == 8 * (4 + 8)  # 8 float32 predictions and int64 targets
    during_test = {row.loop: row for row in model.rows["test"][-1]}
    assert (during_test["test"].bytes, during_test["test"].device) == (12 * (4 + 8), "cpu")
    # the fit's validation holds nothing now: the Metric's state is the test's
    assert (during_test["fit_validation"].bytes, during_test["fit_validation"].device) == (0, "-")
    assert during_test["fit_validation"].kind == "BinaryAUROC"
