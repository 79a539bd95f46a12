"""What Metrics keep: a torchmetrics Metric run on the CPU, off the training step (``offload_to_cpu``)."""

from lightning_store.metrics.offload import offload_to_cpu

__all__ = ["offload_to_cpu"]
