"""Small fits drawn at random, each run plainly and configured every way a user can: every value logged the same.

Each fit logs a torchmetrics Metric (or a collection, with ``log_dict``) in training and validation, on the step
or the epoch, by ``update`` or by ``forward``, beside a loss with a reduction; the Trainer accumulates gradients,
validates within the epoch, runs sanity checks, or not, as drawn. Run with ``store_on_cpu=True``, under
``lightning_store.Trainer(move_metrics_to_cpu=True)``, with the Metrics given to ``store_states_on_cpu`` and
offloaded to each worker, every ``log_metrics`` call and the callback metrics at the end are those of the plain
fit, bit for bit.
"""

import random
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from _support import assert_same
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics import MeanMetric, MetricCollection
from torchmetrics.classification import MulticlassAccuracy, MulticlassAUROC

import lightning_store
from lightning_store import StoreOnCPUDeprecationWarning, StoreOnCPUMixin, offload_to_cpu, store_states_on_cpu
from lightning_store._selfcheck._fits import MemoryLogger

# lightning-store's own, which the fits provoke by design and other tests hold to their text: a Metric logged with
# `store_on_cpu=True` (logged as usual), and `store_states_on_cpu` given a Metric without a list state
pytestmark = pytest.mark.filterwarnings("ignore::lightning_store.warnings.StoreOnCPUWarning")

CONFIGS = 8
TRAINER_SETTINGS = (
    "max_epochs",
    "accumulate_grad_batches",
    "num_sanity_val_steps",
    "limit_val_batches",
    "val_check_interval",
)
WAYS = ("store_on_cpu", "move_metrics_to_cpu", "store_states_on_cpu", "thread", "process")


def _metric(kind: str) -> Any:
    if kind == "accuracy":
        return MulticlassAccuracy(4)
    if kind == "auroc":
        return MulticlassAUROC(4, thresholds=None)  # list states
    if kind == "mean of the loss":
        return MeanMetric()
    return MetricCollection({"acc": MulticlassAccuracy(4), "auroc": MulticlassAUROC(4, thresholds=20)})


class _Model(StoreOnCPUMixin, pl.LightningModule):
    def __init__(self, config: dict[str, Any], way: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.config, self.way = config, way
        self.net = torch.nn.Linear(8, 4)
        self.train_metric, self.val_metric = _metric(config["metric"]), _metric(config["metric"])
        if way == "store_states_on_cpu":
            self.train_metric, self.val_metric = (
                store_states_on_cpu(self.train_metric),
                store_states_on_cpu(self.val_metric),
            )
        elif way in ("thread", "process"):
            self.train_metric = offload_to_cpu(self.train_metric, worker=way)
            self.val_metric = offload_to_cpu(self.val_metric, worker=way)

    def _log(self, name: str, value: Any, **kwargs: Any) -> None:
        store = {"store_on_cpu": True} if self.way == "store_on_cpu" else {}
        if isinstance(value, MetricCollection):
            self.log_dict(value, **kwargs, **store)
        else:
            self.log(name, value, **kwargs, **store)

    def _inputs(self, batch: Any) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
        x, y = batch
        logits = self.net(x)
        loss = torch.nn.functional.cross_entropy(logits, y)
        if self.config["metric"] == "mean of the loss":
            return (loss.detach(),), loss
        return (logits.softmax(-1).detach(), y), loss

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        inputs, loss = self._inputs(batch)
        if self.config["forward"] and not isinstance(self.train_metric, MetricCollection):
            self._log("train_batch_value", self.train_metric(*inputs), on_step=True, on_epoch=False)
        else:
            self.train_metric.update(*inputs)
        self._log("train_metric", self.train_metric, on_step=self.config["on_step"], on_epoch=True)
        self._log("loss", loss, on_step=True, on_epoch=True, reduce_fx=self.config["reduce_fx"])
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        inputs, loss = self._inputs(batch)
        self.val_metric.update(*inputs)
        self._log("val_metric", self.val_metric, on_epoch=True)
        self._log("val_loss", loss)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _config(seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    config = {
        "metric": rng.choice(["accuracy", "auroc", "mean of the loss", "a collection"]),
        "on_step": rng.random() < 0.5,
        "forward": rng.random() < 0.3,
        "reduce_fx": rng.choice(["mean", "sum", "max"]),
        "rows": rng.choice([64, 100]),
        "batch_size": rng.choice([16, 50]),
        "max_epochs": rng.choice([1, 2]),
        "accumulate_grad_batches": rng.choice([1, 2]),
        "num_sanity_val_steps": rng.choice([0, 2]),
        "limit_val_batches": rng.choice([0, 2, 1.0]),
    }
    config["val_check_interval"] = rng.choice([1.0, 0.5]) if config["limit_val_batches"] else 1.0
    return config


def _fit(config: dict[str, Any], way: str, trainer_kwargs: dict[str, Any]) -> dict[str, Any]:
    generator = torch.Generator().manual_seed(0)
    x, y = (
        torch.randn(config["rows"], 8, generator=generator),
        torch.randint(0, 4, (config["rows"],), generator=generator),
    )
    loader = DataLoader(TensorDataset(x, y), batch_size=config["batch_size"])
    recorder = MemoryLogger()
    settings = {
        **trainer_kwargs,
        "logger": recorder,
        "log_every_n_steps": 1,
        **{key: value for key, value in config.items() if key in TRAINER_SETTINGS},
    }
    if way == "move_metrics_to_cpu":
        with pytest.warns(StoreOnCPUDeprecationWarning, match="move_metrics_to_cpu"):
            trainer: pl.Trainer = lightning_store.Trainer(move_metrics_to_cpu=True, **settings)
    else:
        trainer = pl.Trainer(**settings)
    trainer.fit(_Model(config, way), loader, loader if config["limit_val_batches"] else None)
    seen = {f"{n}:{step}:{key}": value for n, (step, row) in enumerate(recorder.history) for key, value in row.items()}
    return {"callback": dict(trainer.callback_metrics), "history": seen}


@pytest.mark.parametrize("seed", range(CONFIGS))
def test_a_random_fit_logs_the_plain_fits_values_every_way(seed, quiet_trainer_kwargs):
    config = _config(seed)
    plain = _fit(config, "plain", quiet_trainer_kwargs)
    assert plain["history"] and plain["callback"]
    for way in WAYS:
        configured = _fit(config, way, quiet_trainer_kwargs)
        assert_same(plain["callback"], configured["callback"])
        assert_same(plain["history"], configured["history"])
