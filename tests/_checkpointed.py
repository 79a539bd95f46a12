"""A LightningModule that keeps its Metric in its hyperparameters, as chemprop's and pytorch-forecasting's do.

Importable without lightning-store: ``configure="none"`` loads a checkpoint where it is not installed.
"""

import pytorch_lightning as pl
import torch
from torchmetrics import Metric


class KeepsItsMetric(pl.LightningModule):
    def __init__(self, metric: Metric, configure: str = "none") -> None:
        super().__init__()
        self.save_hyperparameters()
        if configure == "store_states_on_cpu":
            from lightning_store import store_states_on_cpu

            store_states_on_cpu(metric)
        elif configure in ("thread", "process"):
            from lightning_store import offload_to_cpu

            offload_to_cpu(metric, worker=configure)
        self.metric = metric
        self.net = torch.nn.Linear(4, 1)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        (x,) = batch
        out = self.net(x).squeeze(-1)
        self.metric.update(torch.sigmoid(out.detach()), (x[:, 0] > 0).long())
        self.log("auroc", self.metric, on_step=False, on_epoch=True)
        return out.square().mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def load_plain(path: str) -> dict:
    """What a checkpoint holds, loaded as a user without lightning-store would: its module and hyperparameters."""
    loaded = KeepsItsMetric.load_from_checkpoint(path, configure="none")
    checkpoint = torch.load(path, weights_only=False)
    metric = checkpoint["hyper_parameters"]["metric"]
    return {
        "class": f"{type(metric).__module__}.{type(metric).__qualname__}",
        "module_metric_class": type(loaded.metric).__qualname__,
        "states": {name: getattr(metric, name) for name in metric._defaults},
        "settings": {"dist_sync_fn": metric.dist_sync_fn, "compute_on_cpu": metric.compute_on_cpu},
        "weights": loaded.state_dict(),
    }
