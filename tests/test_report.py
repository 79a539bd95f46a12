import pytorch_lightning as pl
import torch
import torchmetrics
from _support import loader

from lightning_store import KeyStorage, StoreOnCPUMixin, format_storage_report, storage_report, store_states_on_cpu


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
        device="cpu",
        bytes=4 + 8 + 4,
        reduce_fx="mean",
        sync_dist=False,
    )  # float32 value, int64 batch size, float32 step value; the epoch value is computed after the hook
    peak = rows[("train", "peak", None)]
    assert (peak.store_on_cpu, peak.reduce_fx, peak.bytes, peak.sync_dist) == (False, "max", 4, False)
    metric = rows[("train", "metric", None)]
    assert (metric.kind, metric.store_on_cpu, metric.reduce_fx) == ("MeanMetric", False, "compute")
    assert metric.bytes >= 8  # MeanMetric keeps a float32 mean value and weight, at least
    for idx in (0, 1):
        val = rows[("fit_validation", "val_loss", idx)]
        assert (val.hook, val.store_on_cpu, val.device) == ("validation_step", True, "cpu")
    assert len(rows) == 5


def test_no_rows_before_anything_is_logged():
    assert storage_report(pl.Trainer(logger=False)) == []


def test_the_table_has_a_header_and_a_line_per_row():
    rows = [
        KeyStorage("train", "training_step", "loss", None, "tensor", True, "cpu", 20, "mean", False),
        KeyStorage("validate", "validation_step", "acc", 1, "Accuracy", False, "cuda:0", 8, "compute", True),
        KeyStorage(
            *("train", "training_step", "auroc", None, "BinaryAUROC", True, "cpu", 8, "compute", False, True, 3, 0.25)
        ),
    ]
    lines = format_storage_report(rows).splitlines()
    assert lines[0].split() == [
        "loop",
        "hook",
        "name",
        "dataloader_idx",
        "kind",
        "store_on_cpu",
        "device",
        "bytes",
        "reduce_fx",
        "sync_dist",
        "offloaded",
        "pending_updates",
        "waited_s",
    ]
    assert lines[1].split() == [
        *("train", "training_step", "loss", "-", "tensor", "True", "cpu", "20", "mean", "False", "False", "0", "0.000")
    ]
    assert lines[3].split()[-3:] == ["True", "3", "0.250"]
    assert lines[2].split()[6] == "cuda:0"
    assert len({line.index("store_on_cpu") for line in lines[:1]}) == 1
    assert all(len(line.split()) == 13 for line in lines)


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
    assert (row.kind, row.store_on_cpu, row.device, row.reduce_fx) == ("CompositionalMetric", True, "cpu", "compute")
    # 10 float32 predictions and 10 int64 targets, counted once: both inner Metrics keep the same tensors
    assert row.bytes == 10 * 4 + 10 * 8
    assert model.shared
