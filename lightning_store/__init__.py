"""Keep what Lightning accumulates for logged values on the CPU: ``self.log(..., store_on_cpu=True)``."""

from lightning_store._compat import _check_lightning_version

_check_lightning_version("pytorch-lightning")  # before Lightning is imported: outside the range it may not import

from lightning_store.metrics import gather_on_device, offload_to_cpu, store_states_on_cpu
from lightning_store.mixin import StoreOnCPUMixin
from lightning_store.report import KeyStorage, format_storage_report, storage_report
from lightning_store.trainer import Trainer
from lightning_store.warnings import StoreOnCPUDeprecationWarning, StoreOnCPUWarning, StorePolicyError

__all__ = [
    "KeyStorage",
    "StoreOnCPUDeprecationWarning",
    "StoreOnCPUMixin",
    "StoreOnCPUWarning",
    "StorePolicyError",
    "Trainer",
    "__version__",
    "format_storage_report",
    "gather_on_device",
    "offload_to_cpu",
    "storage_report",
    "store_states_on_cpu",
]

__version__ = "0.2.0.dev0"
