"""A configured Metric is the same Metric as the unconfigured one: values, dtypes, merge, TorchScript, DDP sync."""

import copy
import warnings
from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch
from _metrics import (
    ELEMENT_METRICS,
    SENTENCES,
    WRAPPERS,
    MeanOfSequenceMax,
    flatten,
    list_state_tensors,
    rouge,
    run_wrapper,
    sequences,
)
from _support import run_workers
from torchmetrics import CatMetric, MeanMetric, Metric, MetricCollection
from torchmetrics.classification import BinaryAUROC

from lightning_store import store_states_on_cpu
from lightning_store.metrics import _configured as states
from lightning_store.metrics._reads import _stores_states_on_cpu

WORKER = Path(__file__).with_name("_states_ddp_worker.py")


def _assert_same(got, expected):
    assert len(got) == len(expected)
    for left, right in zip(got, expected, strict=True):
        assert left.dtype == right.dtype and left.shape == right.shape, (left, right)
        assert torch.equal(left, right), (left, right)


# -- list states kept one element per item, in one process


@pytest.mark.parametrize("name", sorted(ELEMENT_METRICS))
@pytest.mark.parametrize("call", ["update", "forward"])
def test_metrics_keeping_one_element_per_item_give_the_plain_values(name, call):
    make, data = ELEMENT_METRICS[name]
    plain, configured = make(), store_states_on_cpu(make())
    for seed in range(3):
        items = data(seed, 3)
        if call == "forward" and name == "user_reduction":  # torchmetrics' forward stacks the lists: it fails
            with pytest.raises(TypeError) as plain_error:
                plain(items)
            with pytest.raises(TypeError, match=f"^{plain_error.value}$"):
                configured(items)
            return
        if call == "forward":
            _assert_same([configured(items)], [plain(items)])
        else:
            plain.update(items)
            configured.update(items)
    _assert_same([configured.compute()], [plain.compute()])
    for attr in states._list_states(plain):  # the same elements, in the same order, on the CPU
        _assert_same(getattr(configured, attr), getattr(plain, attr))


def test_rouge_gives_the_plain_values():
    plain, configured = rouge(), store_states_on_cpu(rouge())
    for pred, target in SENTENCES:
        _assert_same(flatten(configured(pred, target)), flatten(plain(pred, target)))
    _assert_same(flatten(configured.compute()), flatten(plain.compute()))
    assert all(t.is_cpu for t in list_state_tensors(configured))


# -- wrappers and collections: the Metrics inside that hold list states are configured


@pytest.mark.parametrize("name", sorted(WRAPPERS))
def test_wrappers_give_the_plain_values_with_their_metrics_configured(name):
    make, _ = WRAPPERS[name]
    configured, plain = store_states_on_cpu(make(), chunk_bytes=4096), make()
    batches = [(seed, 4 + seed) for seed in range(4)]
    _assert_same(run_wrapper(name, configured, batches), run_wrapper(name, plain, batches))
    metrics = [m for m in configured.modules() if isinstance(m, Metric)]
    assert any(_stores_states_on_cpu(m) for m in metrics)
    for metric in metrics:  # every Metric that holds list states of its own, and only those
        assert _stores_states_on_cpu(metric) == states._owns_list_states(metric), type(metric).__name__
        if _stores_states_on_cpu(metric):
            assert metric.dist_sync_fn.keywords == {"chunk_bytes": 4096}
            assert all(t.is_cpu for t in list_state_tensors(metric))


# -- dtype: every conversion of torchmetrics, the list states staying on the CPU

CONVERSIONS = {
    "metric.to(float64)": lambda m: m.to(torch.float64),
    "module.to(float64)": lambda m: torch.nn.ModuleList([m]).to(torch.float64),
    "to(cpu, float64)": lambda m: m.to("cpu", torch.float64),
    "to(dtype=float16)": lambda m: m.to(dtype=torch.float16),
    "set_dtype(float64)": lambda m: m.set_dtype(torch.float64),
    "double()": lambda m: m.double(),
    "half()": lambda m: m.half(),
    "type(float64)": lambda m: m.type(torch.float64),
}


@pytest.mark.parametrize("conversion", sorted(CONVERSIONS))
@pytest.mark.parametrize("make", [CatMetric, ELEMENT_METRICS["matrices"][0]], ids=["cat", "matrices"])
def test_dtype_conversions_follow_torchmetrics(conversion, make):
    data = ELEMENT_METRICS["matrices"][1]
    plain, configured = make(), store_states_on_cpu(make())
    for metric in (plain, configured):
        metric.update(data(0, 3) if make is not CatMetric else data(0, 1)[0])
        CONVERSIONS[conversion](metric)
        metric.update(data(1, 2) if make is not CatMetric else data(1, 1)[0])
    for attr in states._list_states(plain):
        _assert_same(getattr(configured, attr), getattr(plain, attr))
    _assert_same([configured.compute()], [plain.compute()])
    assert getattr(configured, "dtype", None) == getattr(plain, "dtype", None)  # `Metric.dtype` is torchmetrics >= 1.1


class _OwnApply(CatMetric):
    """Overrides ``_apply`` without ``exclude_state``, as ``MeanAveragePrecision`` does."""

    def _apply(self, fn):
        return super()._apply(fn, exclude_state=("value",))


def test_a_metric_with_an_apply_of_its_own_converts_as_the_plain_one():
    plain, configured = _OwnApply(), store_states_on_cpu(_OwnApply())
    for metric in (plain, configured):
        metric.update(torch.tensor([1.0, 2.0]))
        metric.to(torch.float64)
    _assert_same(configured.value, plain.value)  # excluded by the Metric itself: left float32 by both
    _assert_same([configured.compute()], [plain.compute()])


def test_a_dtype_conversion_lands_the_copies_in_flight_first(fake_device):
    metric = store_states_on_cpu(CatMetric())
    metric.update(torch.tensor([1.0, 2.0]))
    metric.to("cpu")  # no dtype to change: no wait
    assert not fake_device.copies[0].waited
    metric.to(torch.float64)
    assert fake_device.copies[0].waited and [t.dtype for t in metric.value] == [torch.float64]
    _assert_same([metric.compute()], [torch.tensor([1.0, 2.0], dtype=torch.float64)])


# -- merge_state, in every direction


@pytest.mark.skipif(not hasattr(CatMetric, "merge_state"), reason="merge_state is torchmetrics >= 1.1")
@pytest.mark.parametrize("into", ["configured", "plain"])
@pytest.mark.parametrize("incoming", ["configured", "plain"])
def test_merge_state_in_every_direction(into, incoming):
    def make(kind, seed):
        metric = BinaryAUROC(thresholds=None)
        metric.update(torch.rand(6, generator=torch.Generator().manual_seed(seed)), torch.tensor([0, 1] * 3))
        return store_states_on_cpu(metric) if kind == "configured" else metric

    target, reference = make(into, 0), make("plain", 0)
    target.merge_state(make(incoming, 1))
    reference.merge_state(make("plain", 1))
    _assert_same([target.compute()], [reference.compute()])


@pytest.mark.skipif(not hasattr(CatMetric, "merge_state"), reason="merge_state is torchmetrics >= 1.1")
def test_merge_state_of_another_class_fails_as_torchmetrics_fails():
    with pytest.raises(ValueError) as plain_error:
        BinaryAUROC(thresholds=None).merge_state(CatMetric())
    with pytest.raises(ValueError) as configured_error:
        store_states_on_cpu(BinaryAUROC(thresholds=None)).merge_state(CatMetric())
    assert str(configured_error.value) == str(plain_error.value)
    assert "Expected incoming state to be an instance of BinaryAUROC" in str(configured_error.value)


# -- TorchScript


def test_a_configured_metric_scripts_as_the_plain_one():
    configured, plain = store_states_on_cpu(BinaryAUROC(thresholds=None)), BinaryAUROC(thresholds=None)
    assert torch.jit.script(configured).original_name == torch.jit.script(plain).original_name == "BinaryAUROC"
    for metric in (configured, plain):  # scripting leaves the Metric as it was
        metric.update(torch.rand(5, generator=torch.Generator().manual_seed(0)), torch.tensor([0, 1, 1, 0, 1]))
    _assert_same([configured.compute()], [plain.compute()])
    assert _stores_states_on_cpu(configured) and all(t.is_cpu for t in configured.preds)


class _ScriptedModel(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(2, 1)
        self.auroc = store_states_on_cpu(BinaryAUROC(thresholds=None))

    def forward(self, x):
        return self.layer(x)


def test_a_lightning_module_holding_one_exports_with_to_torchscript():
    model = _ScriptedModel()
    model.auroc.update(torch.rand(4), torch.tensor([0, 1, 1, 0]))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Lightning 2.6 deprecates to_torchscript for 2.8
        scripted = model.to_torchscript()
    x = torch.rand(3, 2)
    _assert_same([scripted(x)], [model(x)])
    assert model.auroc.compute().dtype == torch.float32 and all(t.is_cpu for t in model.auroc.preds)


# -- messages


def test_a_numpy_chunk_bytes_names_its_type():
    numpy = pytest.importorskip("numpy")
    with pytest.raises(TypeError, match=r"Expected chunk_bytes to be an int, got \S*1024\S* \(numpy.int64\)"):
        store_states_on_cpu(CatMetric(), chunk_bytes=numpy.int64(1024))


# -- late copies: the non-blocking path on the CPU


def test_copies_in_flight_land_in_the_new_lists_of_a_move(fake_device):
    metric = store_states_on_cpu(CatMetric())
    metric.update(torch.tensor([1.0]))
    metric.update(torch.tensor([2.0]))
    before = metric.value
    metric.to("cpu")  # as Lightning does at every self.log: torchmetrics gives each list state a new list
    assert metric.value is not before and not any(copy_.waited for copy_ in fake_device.copies)
    for copy_ in fake_device.copies:
        copy_.land()
    metric.update(torch.tensor([3.0]))  # folds what landed
    assert [getattr(t, "landed", False) for t in metric.value] == [True, True, False]
    _assert_same([metric.compute()], [torch.tensor([1.0, 2.0, 3.0])])


# -- 2 processes on gloo


@pytest.fixture(scope="module")
def ddp_checks(tmp_path_factory):
    return run_workers(WORKER, tmp_path_factory.mktemp("states_ddp"), world_size=2)


@pytest.mark.distributed
def test_two_processes_give_the_values_of_the_plain_metric(ddp_checks):
    for rank, seen in enumerate(ddp_checks):
        failed = {name: check for name, check in seen["checks"].items() if not check["ok"]}
        assert not failed, (rank, failed)


@pytest.mark.distributed
def test_two_processes_cover_every_case(ddp_checks):
    names = set(ddp_checks[0]["checks"])
    assert names == set(ddp_checks[1]["checks"])
    expected = {"elements_mixed", "elements_empty_rank", "elements_none_anywhere", "elements_complex_bfloat16"}
    expected |= {"elements_every_dtype", "objects_of_its_own_16", "objects_of_its_own_state_16"}
    for name in ELEMENT_METRICS:
        expected |= {f"{name}_state_16", f"{name}_16", f"{name}_uneven_3_1", f"{name}_uneven_0_2"}
    expected |= {f"wrapper_{name}" for name in WRAPPERS} | {"rouge", "dtype_float64", "dtype_float16_elements"}
    expected |= {"cat_empty_everywhere"}
    assert expected <= names, expected - names
    assert all(check["local_kept"] for name, check in ddp_checks[0]["checks"].items() if name.startswith("elements"))


# -- CUDA and NCCL (skipped without a GPU)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_elements_of_one_item_each_sync_through_nccl(tmp_path):
    if not torch.distributed.is_nccl_available():
        pytest.skip("needs NCCL")
    torch.distributed.init_process_group("nccl", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        configured = store_states_on_cpu(MeanOfSequenceMax(), chunk_bytes=64).cuda()
        plain = MeanOfSequenceMax().cuda()
        for seed in range(3):
            items = [s.cuda() for s in sequences(seed, 4)]
            configured.update(items)
            plain.update(items)
        assert all(t.is_cpu for t in configured.sequences)
        _assert_same(configured.sequences, [t.cpu() for t in plain.sequences])  # the same elements, in order
        torch.testing.assert_close(configured.compute(), plain.compute().cpu())  # reduced on the CPU: last bits
        configured.to("cuda", torch.float64)  # the dtype reaches the list states, which stay on the CPU
        assert {(t.device.type, t.dtype) for t in configured.sequences} == {("cpu", torch.float64)}
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_a_wrapped_metric_keeps_its_list_states_on_the_cpu():
    from torchmetrics.classification import MulticlassAUROC
    from torchmetrics.wrappers import ClasswiseWrapper

    def make():
        return ClasswiseWrapper(MulticlassAUROC(num_classes=3, thresholds=None, average=None))

    configured, plain = store_states_on_cpu(make()).cuda(), make().cuda()
    for seed in range(3):
        generator = torch.Generator().manual_seed(seed)
        preds, target = torch.rand(8, 3, generator=generator).softmax(-1).cuda(), (torch.arange(8) % 3).cuda()
        configured.update(preds, target)
        plain.update(preds, target)
    assert all(t.is_cpu for t in configured.metric.preds + configured.metric.target)
    got, expected = configured.compute(), plain.compute()
    assert sorted(got) == sorted(expected)
    for key in got:  # computed on the CPU: equal up to the last bits
        torch.testing.assert_close(got[key], expected[key].cpu())


# -- MeanMetric and the like: nothing to configure


def test_a_wrapper_of_metrics_without_list_states_warns_and_is_left_as_it_is():
    from torchmetrics.wrappers import MinMaxMetric

    from lightning_store import StoreOnCPUWarning

    wrapper = MinMaxMetric(MeanMetric())
    with pytest.warns(StoreOnCPUWarning, match="got a MinMaxMetric, which has no list state") as record:
        assert store_states_on_cpu(wrapper) is wrapper
    assert record[0].filename == __file__
    assert not any(_stores_states_on_cpu(m) for m in wrapper.modules())


def test_a_collection_of_wrappers_configures_every_holder_once():
    from torchmetrics.wrappers import BootStrapper

    collection = store_states_on_cpu(
        MetricCollection({"boot": BootStrapper(BinaryAUROC(thresholds=None), num_bootstraps=2), "cat": CatMetric()})
    )
    holders = [m for m in collection.modules() if _stores_states_on_cpu(m)]
    assert [type(m).__name__ for m in holders] == ["BinaryAUROC", "BinaryAUROC", "CatMetric"]
    assert len({id(m._cpu_states) for m in holders}) == 1
    again = copy.deepcopy(collection)
    assert sum(_stores_states_on_cpu(m) for m in again.modules()) == 3
