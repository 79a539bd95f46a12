"""What the rest of lightning-store asks of a Metric: how it is configured, and its states settled to be read.

The one face of ``metrics/`` for the ``self.log`` half (``mixin``, ``report``, the flag's hooks): they import from
here, never from the modules behind it.
"""

from torch.nn import Module
from torchmetrics import Metric

from lightning_store.metrics._configured import _metrics_in, _owns_list_states, _queue_of
from lightning_store.metrics._gather import _is_gather_on_device
from lightning_store.metrics._states_on_cpu import _StatesOnCPU
from lightning_store.metrics.states import _ACCEPTED, _configure_together

__all__ = [
    "_ACCEPTED",
    "_configure_together",
    "_configured_by_flag",
    "_is_gather_on_device",
    "_is_offloaded",
    "_metrics_in",
    "_owns_list_states",
    "_queue_of",
    "_settle_states",
    "_stores_states_on_cpu",
]


def _is_offloaded(obj: Module) -> bool:
    """Whether ``obj`` was given to ``offload_to_cpu``, or is inside what was: it holds a queue."""
    return _queue_of(obj) is not None


def _stores_states_on_cpu(metric: Metric) -> bool:
    """Whether ``metric`` was given to ``store_states_on_cpu`` (by the user, or by the flag)."""
    return isinstance(metric, _StatesOnCPU)


def _configured_by_flag(metric: Metric) -> bool:
    """Whether ``Trainer(move_metrics_to_cpu=True)``, not the user, gave ``metric`` to ``store_states_on_cpu``."""
    return isinstance(metric, _StatesOnCPU) and metric._cpu_states.by_flag


def _settle_states(metric: Metric) -> None:
    """Land the copies in flight of a Metric given to ``store_states_on_cpu``, before its states are read."""
    if isinstance(metric, _StatesOnCPU):
        metric._settle_states()
