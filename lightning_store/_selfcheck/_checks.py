"""The registry: every check of ``python -m lightning_store``, in the order it runs and prints."""

from lightning_store._selfcheck._core import Check
from lightning_store._selfcheck._cuda import check_nccl_sync_dist, check_no_sync
from lightning_store._selfcheck._in_place import check_in_place
from lightning_store._selfcheck._metric import check_metric_nccl_sync, check_metric_states
from lightning_store._selfcheck._offload import check_offload
from lightning_store._selfcheck._offload_pays import check_offload_pays
from lightning_store._selfcheck._timing import check_step_time
from lightning_store._selfcheck._values import check_storage, check_values

CHECKS: list[Check] = [
    Check("values", "values identical", check_values),
    Check("cpu_storage", "state on the CPU during the fit", check_storage),
    Check("no_sync", "no host sync in self.log", check_no_sync),
    Check("nccl_sync_dist", "sync_dist through NCCL", check_nccl_sync_dist),
    Check("step_time", "step time (measured)", check_step_time),
    Check("metric_states", "Metric list states on the CPU", check_metric_states),
    Check("metric_nccl_sync", "Metric sync through NCCL", check_metric_nccl_sync),
    Check("in_place", "changed in place after the call", check_in_place),
    Check("offload", "Metric offloaded to the CPU", check_offload),
    Check("offload_pays", "offload beside a Python step (measured)", check_offload_pays),
]
