"""A fit whose Metrics run on the CPU, off the training step: ``offload_to_cpu``, against the same Metrics inline.

A heavy Metric (a 100-threshold AUROC and a 100-class confusion matrix over every prediction of a step) is updated
in ``training_step``; offloaded to a worker thread, its update runs while the step goes on. It is sized as the
case offloading is for: the update (about 17 ms on a 2-CPU machine, mostly torch ops) is shorter than the rest of
the step (about 35 ms), and far longer than handing it to the worker (under 1 ms). The values are the plain
Metric's, bit for bit; the storage report, taken during the fit, shows each offloaded Metric with its pending
updates. Each epoch is timed, inline and offloaded.

A model on the CPU runs tensor ops in its step, which a worker thread does not slow: it starts at once. With the
default worker, a process, the later epochs are shorter still, but the first one also pays the seconds the worker
process takes to start, which a fit of three short epochs does not win back.

    python examples/offload_to_cpu.py
"""

import time

import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics import MetricCollection
from torchmetrics.classification import MulticlassAUROC, MulticlassConfusionMatrix

from lightning_store import format_storage_report, offload_to_cpu, storage_report

CLASSES = 100
HIDDEN = 4096  # a step of about 35 ms on one core: longer than the Metric's update, so that the worker keeps up
EPOCHS = 3


class EpochTimes(pl.Callback):
    def __init__(self) -> None:
        self.seconds: list[float] = []

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        self.started = time.perf_counter()

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        self.seconds.append(time.perf_counter() - self.started)


class LitClassifier(pl.LightningModule):
    def __init__(self, offload: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(64, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, CLASSES))
        self.scores = MetricCollection(
            {"auroc": MulticlassAUROC(CLASSES, thresholds=100), "confmat": MulticlassConfusionMatrix(CLASSES)}
        )
        if offload:
            # the same Metrics, configured in place. A model on the CPU: a worker thread, which starts at once (a
            # worker process, the default, is for a step that runs Python, and its start would fill the first epoch)
            offload_to_cpu(self.scores, worker="thread")
        self.rows: list = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self.net(x)
        self.scores.update(logits.softmax(dim=-1).detach(), y)  # returns at once when offloaded
        self.log("auroc", self.scores["auroc"], on_step=False, on_epoch=True)
        if batch_idx == 5:
            self.rows = storage_report(self.trainer)
        return torch.nn.functional.cross_entropy(logits, y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def main() -> None:
    torch.set_num_threads(1)  # the model on one thread: the Metric's update gets the other core when offloaded
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(16384, 64, generator=generator)
    y = torch.randint(0, CLASSES, (16384,), generator=generator)
    results = {}
    for offload in (False, True):
        model, epochs = LitClassifier(offload), EpochTimes()
        trainer = pl.Trainer(
            max_epochs=EPOCHS,
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            enable_checkpointing=False,
            callbacks=[epochs],
        )
        trainer.fit(model, DataLoader(TensorDataset(x, y), batch_size=512))
        confmat = model.scores["confmat"].compute()  # waits for the queued updates, then computes
        results[offload] = (epochs.seconds, trainer.callback_metrics["auroc"], confmat)
        if offload:
            print("During the fit (the offloaded Metrics, with their pending updates):")
            print(format_storage_report(model.rows))
    (inline_s, auroc, confmat), (offload_s, offload_auroc, offload_confmat) = results[False], results[True]
    print(f"\nauroc: inline {auroc.item():.6f}, offloaded {offload_auroc.item():.6f}")
    print(f"bit for bit: {torch.equal(auroc, offload_auroc) and torch.equal(confmat, offload_confmat)}")
    for epoch, (inline, offloaded) in enumerate(zip(inline_s, offload_s, strict=True)):
        print(f"epoch {epoch}: inline {inline:.2f} s, offloaded {offloaded:.2f} s ({offloaded / inline:.2f}x)")


if __name__ == "__main__":
    main()
