import subprocess
import sys
from importlib.metadata import PackageNotFoundError, version

import pytest
from _support import HANG_S

import lightning_store

PUBLIC = {
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
}


def test_the_public_api_is_exactly_all():
    assert set(lightning_store.__all__) == PUBLIC
    public_attributes = {name for name in vars(lightning_store) if not name.startswith("_")}
    # submodules are importable, but the API is what `__all__` lists
    submodules = {"lightning", "metrics", "mixin", "report", "trainer", "warnings"}
    assert public_attributes - PUBLIC <= submodules


def test_every_public_name_has_a_docstring_with_an_example():
    for name in PUBLIC - {"__version__"}:
        doc = getattr(lightning_store, name).__doc__
        assert doc and "Example:" in doc, name


def _installed_version() -> str | None:
    try:
        return version("lightning-store")
    except PackageNotFoundError:
        return None


@pytest.mark.skipif(
    _installed_version() is None,
    reason="lightning-store is not installed here (a checkout on PYTHONPATH, say): it has no installed version",
)
def test_the_version_is_defined_once_and_installed_as_such():
    assert lightning_store.__version__ == _installed_version()


def test_importing_the_package_patches_nothing():
    """Lightning, torch and torchmetrics look the same before and after ``import lightning_store``."""
    probe = """
import pytorch_lightning as pl, torch, torchmetrics
from pytorch_lightning.trainer.connectors.logger_connector import result
targets = [pl.LightningModule, pl.Trainer, result._ResultCollection, result._ResultMetric, result._Sync,
           torchmetrics.Metric, torch.Tensor, pl.strategies.DDPStrategy]
snapshot = lambda: {(t.__name__, k): id(v) for t in targets for k, v in vars(t).items()}
before, modules_before = snapshot(), {k: id(v) for k, v in vars(result).items()}
import importlib.util, lightning_store
if importlib.util.find_spec("lightning") is not None:  # the namespace module exists for that package only
    import lightning_store.lightning
assert snapshot() == before, sorted(set(snapshot().items()) ^ set(before.items()))
assert {k: id(v) for k, v in vars(result).items()} == modules_before
print("unchanged", len(before))
"""
    completed = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=HANG_S)
    assert completed.returncode == 0, completed.stderr[-3000:]
    assert completed.stdout.startswith("unchanged")
