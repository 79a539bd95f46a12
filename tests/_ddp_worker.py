"""Run by tests/test_distributed.py: a real 2-process DDP fit on the CPU (gloo), each rank writing what it saw.

Usage: python tests/_ddp_worker.py OUT_DIR. Lightning starts the second rank by running this script again.
"""

import json
import sys
from pathlib import Path

import pytorch_lightning as pl
import torch
from _support import REDUCTIONS, stored_tensors
from torch.utils.data import DataLoader, TensorDataset

from lightning_store import StoreOnCPUMixin
from lightning_store._logged.result import _StoredOnCPU
from lightning_store._selfcheck._fits import MemoryLogger

STEPS = 3  # per rank and epoch


class SyncModel(StoreOnCPUMixin, pl.LightningModule):
    """Logs, per reduction and level, the same rank-dependent values twice: stored on the CPU and as usual."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(1, 1)

    def _log(self, stage: str, batch_idx: int) -> None:
        value = torch.tensor(10.0 * (self.global_rank + 1) + batch_idx)
        for reduce_fx in REDUCTIONS:
            for on_step, on_epoch in ((True, False), (False, True), (True, True)):
                for store_on_cpu in (True, False):
                    name = f"{'cpu' if store_on_cpu else 'dev'}_{stage}_{reduce_fx}_{int(on_step)}{int(on_epoch)}"
                    self.log(
                        name,
                        value,
                        reduce_fx=reduce_fx,
                        on_step=on_step,
                        on_epoch=on_epoch,
                        sync_dist=True,
                        batch_size=batch_idx + 1,
                        store_on_cpu=store_on_cpu,
                    )

    def training_step(self, batch, batch_idx):
        self._log("train", batch_idx)
        return self.layer(batch[0]).sum()

    def validation_step(self, batch, batch_idx):
        self._log("val", batch_idx)

    def on_train_end(self) -> None:
        results = self.trainer.fit_loop.epoch_loop._results
        self.storage = {
            key: [type(result).__name__, [t.device.type for t in stored_tensors(result)]]
            for key, result in results.items()
        }
        self.stored_keys = sorted(key for key, result in results.items() if isinstance(result, _StoredOnCPU))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


def main(out_dir: Path) -> None:
    data = DataLoader(TensorDataset(torch.ones(2 * STEPS, 1)), batch_size=1)
    recorder = MemoryLogger()
    trainer = pl.Trainer(
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
    )
    model = SyncModel()
    trainer.fit(model, data, data)
    seen = {
        "callback_metrics": {k: v.item() for k, v in trainer.callback_metrics.items()},
        "devices": {k: v.device.type for k, v in trainer.callback_metrics.items()},
        # the last value each key handed to the loggers (validation step values reach no other dict)
        "logged": {k: float(v) for _, metrics in recorder.history for k, v in metrics.items()},
        "storage": model.storage,
        "stored_keys": model.stored_keys,
    }
    (out_dir / f"rank{trainer.global_rank}.json").write_text(json.dumps(seen))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
