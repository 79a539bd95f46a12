"""A checkpoint of a module whose hyperparameters hold a configured Metric loads where lightning-store is not
installed, as the plain Metric; where it is, the code that configured it configures it again."""

import copy
import os
import pickle
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch
from _checkpointed import KeepsItsMetric
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics import MetricCollection
from torchmetrics.classification import BinaryAUROC

from lightning_store import StoreOnCPUDeprecationWarning, Trainer, offload_to_cpu, store_states_on_cpu
from lightning_store.metrics._reads import _is_offloaded
from lightning_store.metrics._states_on_cpu import _StatesOnCPU

pytestmark = [
    # Lightning's advice against a Module in the hyperparameters: the case these tests are about
    pytest.mark.filterwarnings("ignore:Attribute 'metric' is an instance of `nn.Module`"),
    # a Metric in the hyperparameters is no weight: plain Lightning loads it with weights_only=False too
    pytest.mark.filterwarnings("ignore:Environment variable TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD detected"),
]
TESTS = Path(__file__).parent
# the subprocess: lightning_store cannot be imported there (as where it is not installed)
_WITHOUT_LIGHTNING_STORE = """
import pickle, sys
sys.modules["lightning_store"] = None
sys.path.insert(0, sys.argv[1])
from _checkpointed import load_plain
sys.stdout.buffer.write(pickle.dumps([load_plain(path) for path in sys.argv[2:]]))
"""


def _data() -> DataLoader:
    generator = torch.Generator().manual_seed(0)
    return DataLoader(TensorDataset(torch.randn(24, 4, generator=generator)), batch_size=6)


def _fit(tmp_path: Path, name: str, trainer_class: type = pl.Trainer, configure: str = "none", **flag: bool) -> str:
    torch.manual_seed(0)
    model = KeepsItsMetric(BinaryAUROC(thresholds=None), configure=configure)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", StoreOnCPUDeprecationWarning)
        trainer = trainer_class(
            max_epochs=2,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            **flag,
        )
    trainer.fit(model, _data())
    # the fit reset the logged Metric at the end of its epoch: an update after it, for states to be saved
    model.metric.update(torch.tensor([0.2, 0.9, 0.4, 0.6]), torch.tensor([0, 1, 1, 0]))
    path = str(tmp_path / f"{name}.ckpt")
    trainer.save_checkpoint(path)
    return path


def _load_without_lightning_store(*paths: str) -> list[dict]:
    run = subprocess.run(
        [sys.executable, "-c", _WITHOUT_LIGHTNING_STORE, str(TESTS), *paths],
        capture_output=True,
        timeout=300,
        env={**os.environ, "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD": "1"},
    )
    assert run.returncode == 0, run.stderr.decode()[-3000:]
    return pickle.loads(run.stdout)


def _assert_same(got: dict, expected: dict) -> None:
    assert got["class"] == expected["class"] == "torchmetrics.classification.auroc.BinaryAUROC"
    assert got["module_metric_class"] == "BinaryAUROC"
    assert got["settings"] == expected["settings"] == {"dist_sync_fn": None, "compute_on_cpu": False}
    assert got["states"].keys() == expected["states"].keys()
    for name, state in expected["states"].items():
        assert len(got["states"][name]) == len(state) > 0
        for a, b in zip(got["states"][name], state, strict=True):
            assert a.dtype == b.dtype and a.device == b.device and torch.equal(a, b)
    assert got["weights"].keys() == expected["weights"].keys()
    for name, weight in expected["weights"].items():
        assert torch.equal(got["weights"][name], weight)


@pytest.mark.parametrize("configure", ["flag", "store_states_on_cpu", "thread", "process"])
def test_a_checkpoint_loads_as_the_plain_one_without_lightning_store(tmp_path, configure):
    plain = _fit(tmp_path, "plain")
    if configure == "flag":
        configured = _fit(tmp_path, configure, Trainer, move_metrics_to_cpu=True)
    else:
        configured = _fit(tmp_path, configure, configure=configure)
    assert b"lightning_store" not in Path(configured).read_bytes()
    expected, got = _load_without_lightning_store(plain, configured)
    _assert_same(got, expected)


@pytest.mark.parametrize("configure", ["store_states_on_cpu", "thread"])
def test_where_lightning_store_is_installed_the_users_init_configures_it_again(tmp_path, monkeypatch, configure):
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    loaded = KeepsItsMetric.load_from_checkpoint(_fit(tmp_path, configure, configure=configure))
    checkpoint = torch.load(str(tmp_path / f"{configure}.ckpt"), weights_only=False)
    assert type(checkpoint["hyper_parameters"]["metric"]) is BinaryAUROC
    if configure == "store_states_on_cpu":
        assert isinstance(loaded.metric, _StatesOnCPU)
    else:
        assert _is_offloaded(loaded.metric)


def test_the_flag_configures_a_loaded_module_again_at_fit_start(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    loaded = KeepsItsMetric.load_from_checkpoint(_fit(tmp_path, "flag", Trainer, move_metrics_to_cpu=True))
    assert type(loaded.metric) is BinaryAUROC
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", StoreOnCPUDeprecationWarning)
        trainer = Trainer(
            max_epochs=1, logger=False, enable_checkpointing=False, enable_model_summary=False, move_metrics_to_cpu=True
        )
    trainer.fit(loaded, _data())
    assert isinstance(loaded.metric, _StatesOnCPU)


def _configured_ones() -> dict[str, object]:
    return {
        "store_states_on_cpu": store_states_on_cpu(BinaryAUROC(thresholds=None, compute_on_cpu=True)),
        "offload_to_cpu": offload_to_cpu(BinaryAUROC(thresholds=None), worker="thread"),
        "a collection offloaded": offload_to_cpu(MetricCollection([BinaryAUROC(thresholds=None)]), worker="thread"),
    }


@pytest.mark.parametrize("name", list(_configured_ones()))
def test_torch_save_writes_the_plain_object_with_the_settings_it_had(tmp_path, name):
    configured = _configured_ones()[name]
    configured.update(torch.tensor([0.2, 0.9, 0.4]), torch.tensor([0, 1, 1]))
    path = tmp_path / "metric.pt"
    torch.save(configured, path)
    assert b"lightning_store" not in path.read_bytes()
    loaded = torch.load(path, weights_only=False)
    assert type(loaded) is configured._base_class  # the Metric's own class
    assert not _is_offloaded(loaded) and not isinstance(loaded, _StatesOnCPU)
    metrics = list(loaded.values()) if isinstance(loaded, MetricCollection) else [loaded]
    for metric in metrics:
        assert metric.dist_sync_fn is None
        assert metric.compute_on_cpu is (name == "store_states_on_cpu")  # as given, before configured
    torch.testing.assert_close(loaded.compute(), configured.compute(), rtol=0, atol=0)


@pytest.mark.parametrize("name", list(_configured_ones()))
@pytest.mark.parametrize("how", ["pickle", "deepcopy"])
def test_other_pickles_keep_the_configuration(name, how):
    configured = _configured_ones()[name]
    copied = pickle.loads(pickle.dumps(configured)) if how == "pickle" else copy.deepcopy(configured)
    assert type(copied) is type(configured)
    assert _is_offloaded(copied) == _is_offloaded(configured)
