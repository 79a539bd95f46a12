"""Keep what Lightning accumulates for logged values on the CPU: ``self.log(..., store_on_cpu=True)``."""

from lightning_store.mixin import StoreOnCPUMixin
from lightning_store.trainer import Trainer
from lightning_store.warnings import StoreOnCPUDeprecationWarning, StoreOnCPUWarning, StorePolicyError

__all__ = [
    "StoreOnCPUDeprecationWarning",
    "StoreOnCPUMixin",
    "StoreOnCPUWarning",
    "StorePolicyError",
    "Trainer",
    "__version__",
]

__version__ = "0.1.0"
