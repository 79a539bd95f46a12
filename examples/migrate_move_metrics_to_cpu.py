"""Migrating from Lightning 1.x ``Trainer(move_metrics_to_cpu=True)``: the old flag, working again, deprecated.

Lightning 2.0 removed the flag (``pytorch_lightning.Trainer(move_metrics_to_cpu=True)`` is a ``TypeError``).
``lightning_store.Trainer`` accepts it, warns that it is deprecated, and makes ``store_on_cpu`` default to True
for the tensors and numbers that ``StoreOnCPUMixin`` modules log. The migration is two lines, then one more:

    1. ``from lightning_store import StoreOnCPUMixin, Trainer``
    2. ``class LitModel(StoreOnCPUMixin, LightningModule)``
    3. later: ``self.log(..., store_on_cpu=True)`` where you want it, and drop the flag.

    python examples/migrate_move_metrics_to_cpu.py
"""

import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_store import StoreOnCPUMixin, Trainer, format_storage_report, storage_report


class OldStyleModel(StoreOnCPUMixin, pl.LightningModule):  # was: class OldStyleModel(pl.LightningModule)
    """Unchanged Lightning 1.x code: no ``store_on_cpu`` anywhere."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        (x,) = batch
        loss = self.layer(x).pow(2).mean()
        self.log("train_loss", loss, on_step=True, on_epoch=True)
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
    print("\nWith the flag, keys logged without store_on_cpu are stored on the CPU:")
    print(format_storage_report(model.rows))
    print(f"\ntrain_loss_epoch = {trainer.callback_metrics['train_loss_epoch'].item():.6f}")


if __name__ == "__main__":
    main()
