"""What Metrics keep, on the CPU: their list states (``store_states_on_cpu``), or all, run off the step.

The other half of the package, ``self.log(..., store_on_cpu=True)``, is what Lightning keeps for logged values.
"""

from lightning_store.metrics._gather import gather_on_device
from lightning_store.metrics.offload import offload_to_cpu
from lightning_store.metrics.states import store_states_on_cpu

__all__ = ["gather_on_device", "offload_to_cpu", "store_states_on_cpu"]
