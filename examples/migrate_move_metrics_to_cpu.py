"""Migrating from Lightning 1.x ``Trainer(move_metrics_to_cpu=True)``: the old flag, working again, deprecated.

Lightning 2.0 removed the flag (``pytorch_lightning.Trainer(move_metrics_to_cpu=True)`` is a ``TypeError``).
``lightning_store.Trainer`` accepts it, warns that it is deprecated, and does what the 1.x flag promised: every
tensor and number any LightningModule logs is stored on the CPU, and the list states of its torchmetrics Metrics
too, with the values of plain Lightning. The migration is one changed import; the module is not touched:

    from lightning_store import Trainer  # was: from pytorch_lightning import Trainer

Later, move to ``self.log(..., store_on_cpu=True)`` (``StoreOnCPUMixin``) and drop the flag.

    python examples/migrate_move_metrics_to_cpu.py
"""

import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics.classification import BinaryAUROC

from lightning_store import Trainer, format_storage_report, storage_report  # was: from pytorch_lightning import Trainer


class OldStyleModel(pl.LightningModule):
    """Unchanged Lightning 1.x code: no ``store_on_cpu`` anywhere, no mixin."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)
        self.auroc = BinaryAUROC(thresholds=None)  # keeps every prediction of an epoch: its lists go to the CPU

    def training_step(self, batch, batch_idx):
        (x,) = batch
        scores = self.layer(x).squeeze(1)
        loss = scores.pow(2).mean()
        self.log("train_loss", loss, on_step=True, on_epoch=True)
        self.auroc(scores.sigmoid(), (x[:, 0] > 0).long())
        self.log("train_auroc", self.auroc, on_step=False, on_epoch=True)
        return loss

    def on_train_epoch_end(self):
        self.rows = storage_report(self.trainer)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def main() -> None:
    try:
        pl.Trainer(move_metrics_to_cpu=True)
    except TypeError as err:
        print(f"pytorch_lightning.Trainer(move_metrics_to_cpu=True) -> TypeError: {err}\n")

    # the deprecation warning points at this line
    trainer = Trainer(
        move_metrics_to_cpu=True,
        max_epochs=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    model = OldStyleModel()
    trainer.fit(model, DataLoader(TensorDataset(torch.randn(64, 4)), batch_size=16))
    print("\nWith the flag, every key a plain module logs is stored on the CPU (a Metric: its list states):")
    print(format_storage_report(model.rows))
    print(f"\ntrain_loss_epoch = {trainer.callback_metrics['train_loss_epoch'].item():.6f}")


if __name__ == "__main__":
    main()
