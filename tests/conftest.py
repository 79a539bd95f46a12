import pytest
import torch

from lightning_store import warnings as store_warnings


@pytest.fixture(autouse=True)
def _fresh_warning_cache():
    """Each test sees lightning-store's once-only warnings anew."""
    store_warnings._cache.clear()
    yield
    store_warnings._cache.clear()


@pytest.fixture
def quiet_trainer_kwargs(tmp_path):
    """Trainer arguments for short CPU runs that write nothing outside ``tmp_path``."""
    return {
        "accelerator": "cpu",
        "devices": 1,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "default_root_dir": tmp_path,
    }


def requires_cuda(fn):
    return pytest.mark.cuda(pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")(fn))
