"""A validation epoch of ``BinaryAUROC(thresholds=None)`` whose predictions and targets are kept on the CPU.

The Metric is configured once with ``store_states_on_cpu`` and logged as usual; the storage report, taken during
the epoch, shows its state on the CPU with its bytes, next to the same Metric kept on its device.

    python examples/metric_states_on_cpu.py
"""

import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics.classification import BinaryAUROC

from lightning_store import format_storage_report, storage_report, store_states_on_cpu


class LitClassifier(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Linear(16, 1)
        self.auroc = store_states_on_cpu(BinaryAUROC(thresholds=None))  # the same Metric, configured
        self.auroc_on_device = BinaryAUROC(thresholds=None)  # for contrast
        self.rows: list = []

    def validation_step(self, batch, batch_idx):
        x, y = batch
        preds = torch.sigmoid(self.net(x)).squeeze(-1)
        self.auroc.update(preds, y)
        self.auroc_on_device.update(preds, y)
        self.log("val_auroc", self.auroc)
        self.log("val_auroc_on_device", self.auroc_on_device)
        self.rows = storage_report(self.trainer)


def main() -> None:
    torch.manual_seed(0)
    x = torch.randn(2048, 16)
    y = (x[:, :4].sum(dim=1) + 0.5 * torch.randn(2048) > 0).long()
    trainer = pl.Trainer(logger=False, enable_progress_bar=False, enable_model_summary=False)
    model = LitClassifier()
    trainer.validate(model, DataLoader(TensorDataset(x, y), batch_size=128), verbose=False)
    print(f"Where each Metric kept its state during the epoch (model on {trainer.strategy.root_device}):")
    print(format_storage_report(model.rows))
    print("\nValues:")
    for name, value in sorted(trainer.callback_metrics.items()):
        print(f"  {name:<20} {value.item():.6f}")


if __name__ == "__main__":
    main()
