"""Run by tests/test_distributed.py: a module without the mixin fitted on 2 CPU processes (gloo) twice, by
``pytorch_lightning.Trainer`` and by ``lightning_store.Trainer(move_metrics_to_cpu=True)``; each rank writes both.

Usage: python tests/_flag_ddp_worker.py OUT_DIR, once per rank (RANK, LOCAL_RANK and WORLD_SIZE set), so that both
fits of a rank run in one process group.
"""

import os
import sys
import warnings
from pathlib import Path

import pytorch_lightning as pl
import torch
from _support import LEVELS, REDUCTIONS, finish_rank, stored_tensors
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics.classification import BinaryAUROC

import lightning_store
from lightning_store._selfcheck._fits import MemoryLogger
from lightning_store.metrics._reads import _stores_states_on_cpu

STEPS = 3  # per rank and epoch


class PlainSyncModel(pl.LightningModule):
    """Logs, per reduction and level, rank-dependent values with ``sync_dist=True``; and a BinaryAUROC."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(1, 1)
        self.auroc = BinaryAUROC(thresholds=None)

    def _log(self, stage: str, batch_idx: int) -> None:
        value = torch.tensor(10.0 * (self.global_rank + 1) + batch_idx) / 3  # not a round number
        for reduce_fx in REDUCTIONS:
            for on_step, on_epoch in LEVELS:
                self.log(
                    f"{stage}_{reduce_fx}_{int(on_step)}{int(on_epoch)}",
                    value,
                    reduce_fx=reduce_fx,
                    on_step=on_step,
                    on_epoch=on_epoch,
                    sync_dist=True,
                    batch_size=batch_idx + 1,
                )
        self.log(f"{stage}_number", float(batch_idx) + self.global_rank / 7, sync_dist=True)

    def training_step(self, batch, batch_idx):
        self._log("train", batch_idx)
        scores = torch.sigmoid(self.layer(batch[0])).squeeze(1) + self.global_rank / 10
        self.auroc.update(scores.clamp(0, 1), (batch[0][:, 0] > 0.5).long())
        return self.layer(batch[0]).sum()

    def on_train_epoch_end(self) -> None:
        self.log("auroc", self.auroc.compute())  # synced by the Metric itself, on gloo
        self.auroc.reset()
        results = self.trainer.fit_loop.epoch_loop._results
        self.storage = {
            key: [type(result).__name__, sorted({t.device.type for t in stored_tensors(result)})]
            for key, result in results.items()
        }

    def validation_step(self, batch, batch_idx):
        self._log("val", batch_idx)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def fit(trainer_class: type, **flag: bool) -> dict:
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(int(os.environ["RANK"]))
    data = DataLoader(TensorDataset(torch.rand(2 * STEPS, 1, generator=generator)), batch_size=2)
    recorder = MemoryLogger()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", lightning_store.StoreOnCPUDeprecationWarning)
        trainer = trainer_class(
            accelerator="cpu",
            devices=2,
            strategy="ddp",
            max_epochs=2,
            logger=recorder,
            log_every_n_steps=1,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            num_sanity_val_steps=0,
            use_distributed_sampler=False,
            **flag,
        )
    model = PlainSyncModel()
    trainer.fit(model, data, data)
    return {
        "callback_metrics": {k: v.item() for k, v in trainer.callback_metrics.items()},
        "devices": {k: v.device.type for k, v in trainer.callback_metrics.items()},
        # every value handed to the loggers, in order (validation step values reach no other dict)
        "logged": [[step, {k: float(v) for k, v in metrics.items()}] for step, metrics in recorder.history],
        "storage": model.storage,
        "auroc_on_cpu": _stores_states_on_cpu(model.auroc),
        "class": type(model).__name__,
    }


def main(out_dir: Path) -> None:
    plain = fit(pl.Trainer)
    flagged = fit(lightning_store.Trainer, move_metrics_to_cpu=True)
    rank = torch.distributed.get_rank()
    finish_rank(out_dir, rank, torch.distributed.get_world_size(), {"plain": plain, "flag": flagged})


if __name__ == "__main__":
    main(Path(sys.argv[1]))
