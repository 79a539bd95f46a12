import os
import sys

import pytest
import torch
from _support import ManualTransfer

from lightning_store import warnings as store_warnings
from lightning_store.metrics import _states_on_cpu as _states


@pytest.fixture(autouse=True)
def _fresh_warning_cache():
    """Each test sees lightning-store's once-only warnings anew."""
    store_warnings._cache.clear()
    yield
    store_warnings._cache.clear()


@pytest.fixture
def kept_environment():
    """The environment as it was before the test: ``LightningCLI`` seeds everything, which sets ``PL_GLOBAL_SEED``."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


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


@pytest.fixture
def fake_device(monkeypatch):
    """For a Metric given to ``store_states_on_cpu``: tensors that came through the buffer count as on the CPU, every
    other as on a device, and copies land when the test says (a :class:`_support.ManualTransfer`)."""
    transfer = ManualTransfer()
    monkeypatch.setattr(_states, "_transfer_for", lambda device: transfer)
    monkeypatch.setattr(_states, "_on_cpu", lambda tensor: getattr(tensor, "landed", False))

    def host_copy(tensor):
        copied = tensor.to("cpu", copy=True)
        copied.landed = True
        return copied

    monkeypatch.setattr(_states, "_host_copy", host_copy)
    return transfer


def requires_cuda(fn):
    return pytest.mark.cuda(pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")(fn))


def pytest_terminal_summary(terminalreporter):
    """How long each multi-process run took (slowest first): the figure to hold against ``_support.HANG_S``."""
    support = sys.modules.get("_support")
    if support is None or not support.RUNS:
        return
    terminalreporter.section("multi-process runs")
    for run in sorted(support.RUNS, key=lambda run: -run.seconds):
        terminalreporter.line(
            f"{run.seconds:6.1f} s  {run.worker}, {run.world_size} processes, {run.attempts} attempt(s)"
            f" (hang bound {support.HANG_S:.0f} s)"
        )
