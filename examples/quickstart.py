"""Quick start: log with ``store_on_cpu=True`` and see where each logged key keeps its state.

Trains a small regressor on synthetic data (on the GPU if there is one, else the CPU) for three epochs, then prints
the storage report taken during the last training epoch and the final value of every logged key.

    python examples/quickstart.py
"""

import shutil

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import Callback
from torch.utils.data import DataLoader, TensorDataset

from lightning_store import StoreOnCPUMixin, format_storage_report, storage_report


class LitRegressor(StoreOnCPUMixin, pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss, prog_bar=True, store_on_cpu=True)
        self.log("train_loss_peak", loss, reduce_fx="max", on_step=False, on_epoch=True, store_on_cpu=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        prediction = self.net(x)
        self.log_dict(
            {
                "val_loss": torch.nn.functional.mse_loss(prediction, y),
                "val_mae": torch.nn.functional.l1_loss(prediction, y),
            },
            store_on_cpu=True,
        )
        # for contrast: its set_by reads "-", and on a GPU its device reads "cuda:0"
        self.log("val_loss_kept_as_usual", torch.nn.functional.mse_loss(prediction, y))

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-2)


class StorageDuringTraining(Callback):
    """Takes the storage report at the end of each training epoch, while the loops still hold their state."""

    def __init__(self) -> None:
        self.rows: list = []

    def on_train_epoch_end(self, trainer, pl_module):
        self.rows = storage_report(trainer)


def data(n: int, seed: int) -> DataLoader:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=generator)
    y = x.sum(dim=1, keepdim=True) + 0.1 * torch.randn(n, 1, generator=generator)
    return DataLoader(TensorDataset(x, y), batch_size=32)


def main() -> None:
    torch.manual_seed(0)
    report = StorageDuringTraining()
    trainer = pl.Trainer(
        max_epochs=3,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[report],
    )
    trainer.fit(LitRegressor(), data(512, seed=1), data(128, seed=2))
    print(f"\nWhere each logged key kept its state during training (model on {trainer.strategy.root_device}):")
    print(format_storage_report(report.rows, width=shutil.get_terminal_size().columns))  # fits the terminal
    print("\nFinal values:")
    for name, value in sorted(trainer.callback_metrics.items()):
        print(f"  {name:<24} {value.item():.6f}  ({value.device})")


if __name__ == "__main__":
    main()
