import copy
import functools
import json
import pickle
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch
from _metrics import list_state_tensors
from _support import loader, run_workers
from torchmetrics import CatMetric, MeanMetric, MetricCollection, SpearmanCorrCoef
from torchmetrics.classification import BinaryAUROC, BinaryAveragePrecision
from torchmetrics.retrieval import RetrievalMAP

from lightning_store import (
    StoreOnCPUWarning,
    format_storage_report,
    gather_on_device,
    storage_report,
    store_states_on_cpu,
)
from lightning_store.metrics import _configured as states
from lightning_store.metrics import _reads as ms
from lightning_store.metrics._states_on_cpu import _StatesOnCPU

WORKER = Path(__file__).with_name("_metric_ddp_worker.py")
SIZES = (5, 7, 3, 6)  # uneven batches


def _batches(kind, seed=0):
    generator = torch.Generator().manual_seed(seed)
    out = []
    for size in SIZES:
        preds = torch.rand(size, generator=generator)
        target = torch.randint(0, 2, (size,), generator=generator)
        if kind == "retrieval":
            out.append(((preds, target), {"indexes": torch.randint(0, 3, (size,), generator=generator)}))
        elif kind == "regression":
            out.append(((preds, preds + torch.rand(size, generator=generator)), {}))
        elif kind == "cat":
            out.append(((preds,), {}))
        else:
            out.append(((preds, target), {}))
    return out


METRICS = {
    "auroc": (lambda: BinaryAUROC(thresholds=None), "binary"),
    "average_precision": (lambda: BinaryAveragePrecision(thresholds=None), "binary"),
    "spearman": (SpearmanCorrCoef, "regression"),
    "retrieval_map": (RetrievalMAP, "retrieval"),
    "cat": (CatMetric, "cat"),
}


def _assert_equal(left, right):
    assert left.dtype == right.dtype
    assert torch.equal(left, right), (left, right)


@pytest.mark.parametrize("name", sorted(METRICS))
@pytest.mark.parametrize("call", ["update", "forward"])
def test_values_are_those_of_the_metric_kept_on_its_device(name, call):
    make, kind = METRICS[name]
    plain, on_cpu = make(), store_states_on_cpu(make())
    for args, kwargs in _batches(kind):
        if call == "forward":
            _assert_equal(plain(*args, **kwargs), on_cpu(*args, **kwargs))
        else:
            plain.update(*args, **kwargs)
            on_cpu.update(*args, **kwargs)
        assert all(t.device.type == "cpu" for t in list_state_tensors(on_cpu))
    _assert_equal(plain.compute(), on_cpu.compute())
    for attr in states._list_states(plain):  # the same elements, in the same order
        assert len(getattr(plain, attr)) == len(getattr(on_cpu, attr))
        for a, b in zip(getattr(plain, attr), getattr(on_cpu, attr), strict=True):
            _assert_equal(a, b)


def test_the_same_metric_is_configured_and_returned():
    metric = BinaryAUROC(thresholds=None)
    assert store_states_on_cpu(metric) is metric
    assert isinstance(metric, BinaryAUROC) and type(metric).__name__ == "BinaryAUROC"
    assert metric.dist_sync_fn.func is gather_on_device


@pytest.mark.parametrize("compute_groups", [True, False])
def test_a_collection_gives_the_values_of_the_collection_kept_on_its_device(compute_groups):
    def make():
        return MetricCollection(
            {
                "auroc": BinaryAUROC(thresholds=None),
                "ap": BinaryAveragePrecision(thresholds=None),
                "mean": MeanMetric(),
            },
            compute_groups=compute_groups,
        )

    plain = make()
    with warnings.catch_warnings():
        warnings.simplefilter("error", StoreOnCPUWarning)  # the collection has list states: nothing to warn about
        on_cpu = store_states_on_cpu(make())
    assert not ms._stores_states_on_cpu(on_cpu["mean"])  # no list state of its own: left as it is
    for step, (args, _) in enumerate(_batches("binary")):
        if step % 2:
            plain.update(*args)
            on_cpu.update(*args)
        else:
            expected, got = plain(*args), on_cpu(*args)
            for key in expected:
                _assert_equal(expected[key], got[key])
    expected, got = plain.compute(), on_cpu.compute()
    assert sorted(expected) == sorted(got)
    for key in expected:
        _assert_equal(expected[key], got[key])
    for metric in on_cpu.values(copy_state=False):
        assert all(t.device.type == "cpu" for t in list_state_tensors(metric))


def test_forward_of_a_collection_returns_the_batch_values_of_the_plain_collection():
    plain = MetricCollection([BinaryAUROC(thresholds=None), BinaryAveragePrecision(thresholds=None)])
    on_cpu = store_states_on_cpu(copy.deepcopy(plain))
    for args, _ in _batches("binary"):
        expected, got = plain(*args), on_cpu(*args)
        for key in expected:
            _assert_equal(expected[key], got[key])
    for key, value in plain.compute().items():
        _assert_equal(value, on_cpu.compute()[key])


def test_compute_on_cpu_is_superseded_and_values_are_unchanged():
    plain = BinaryAUROC(thresholds=None)
    metric = store_states_on_cpu(BinaryAUROC(thresholds=None, compute_on_cpu=True))
    assert metric.compute_on_cpu is False
    for args, _ in _batches("binary"):
        plain.update(*args)
        metric.update(*args)
    _assert_equal(plain.compute(), metric.compute())


def test_calling_it_twice_is_harmless_and_sets_chunk_bytes():
    metric = store_states_on_cpu(BinaryAUROC(thresholds=None))
    for args, _ in _batches("binary")[:2]:
        metric.update(*args)
    update = metric.update
    assert store_states_on_cpu(metric, chunk_bytes=1024) is metric
    assert metric.update is update and type(metric).__mro__.count(_StatesOnCPU) == 1
    assert metric.dist_sync_fn.keywords == {"chunk_bytes": 1024}
    assert len(metric.preds) == 2


def test_a_metric_updated_before_keeps_its_state():
    plain, metric = BinaryAUROC(thresholds=None), BinaryAUROC(thresholds=None)
    for args, _ in _batches("binary"):
        plain.update(*args)
        metric.update(*args)
    _assert_equal(plain.compute(), store_states_on_cpu(metric).compute())


def test_anything_else_is_a_type_error():
    with pytest.raises(
        TypeError,
        match=r"store_states_on_cpu\(\) takes a torchmetrics Metric \(a wrapper too\), MetricCollection or"
        r" MetricTracker, got torch.nn.modules.linear.Linear. HINT: pass the Metric itself",
    ):
        store_states_on_cpu(torch.nn.Linear(1, 1))


def test_a_class_is_refused_with_the_call_to_write():
    with pytest.raises(
        TypeError,
        match=r"got the class BinaryAUROC itself, not a Metric made from it. HINT: call the class, with parentheses:"
        r" `store_states_on_cpu\(BinaryAUROC\(...\)\)`",
    ):
        store_states_on_cpu(BinaryAUROC)


def test_chunk_bytes_must_be_an_int():
    with pytest.raises(TypeError, match=r"Expected chunk_bytes to be an int, got '1MB' \(str\)"):
        store_states_on_cpu(CatMetric(), chunk_bytes="1MB")


def test_chunk_bytes_must_be_positive():
    with pytest.raises(ValueError, match="Expected chunk_bytes to be positive, got 0"):
        store_states_on_cpu(CatMetric(), chunk_bytes=0)


def test_a_dist_sync_fn_of_its_own_is_refused():
    def own(tensor, group=None):
        return [tensor]

    with pytest.raises(ValueError, match=r"HINT: drop dist_sync_fn; store_states_on_cpu sets it to gather_on_device"):
        store_states_on_cpu(CatMetric(dist_sync_fn=own))
    metric = store_states_on_cpu(CatMetric(dist_sync_fn=gather_on_device))  # ours is welcome
    assert metric.dist_sync_fn.func is gather_on_device


def test_a_metric_without_list_state_warns_that_there_is_nothing_to_move():
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        metric = store_states_on_cpu(MeanMetric())  # the reported line
        line = sys._getframe().f_lineno - 1
    [warning] = [w for w in record if issubclass(w.category, StoreOnCPUWarning)]
    assert "got a MeanMetric, which has no list state: there is nothing to move to the CPU" in str(warning.message)
    assert (warning.filename, warning.lineno) == (__file__, line)
    metric.update(torch.tensor([1.0, 2.0]))
    assert metric.compute() == 1.5


def test_module_moves_leave_list_states_on_the_cpu_and_set_the_device():
    metric = store_states_on_cpu(MetricCollection({"cat": CatMetric(), "mean": MeanMetric()}))
    metric.update(torch.tensor([1.0, 2.0]))
    metric.to("meta")  # any device: tensor states follow, list states stay
    cat, mean = metric["cat"], metric["mean"]
    assert cat.device.type == "meta" and {getattr(mean, name).device.type for name in mean._defaults} == {"meta"}
    assert [t.device.type for t in cat.value] == ["cpu"]


def test_set_dtype_converts_list_states_on_the_cpu():
    metric = store_states_on_cpu(CatMetric())
    metric.update(torch.tensor([1.0, 2.0]))
    metric.set_dtype(torch.float64)
    _assert_equal(metric.compute(), torch.tensor([1.0, 2.0], dtype=torch.float64))


def test_pickle_and_deepcopy_keep_values_and_configuration():
    metric = store_states_on_cpu(BinaryAUROC(thresholds=None), chunk_bytes=4096)
    for args, _ in _batches("binary")[:3]:
        metric.update(*args)
    for clone in (pickle.loads(pickle.dumps(metric)), copy.deepcopy(metric), metric.clone()):
        assert ms._stores_states_on_cpu(clone) and clone.dist_sync_fn.keywords == {"chunk_bytes": 4096}
        _assert_equal(clone.compute(), metric.compute())
        args, _ = _batches("binary")[3]
        clone.update(*args)  # still collects: its update is wrapped again
        assert len(clone.preds) == 4 and clone._cpu_states is not metric._cpu_states
    assert len(metric.preds) == 3


def test_a_fresh_process_unpickles_it(tmp_path):
    metric = store_states_on_cpu(MetricCollection([BinaryAUROC(thresholds=None), CatMetric()]))
    for args, _ in _batches("binary"):
        metric["BinaryAUROC"].update(*args)
        metric["CatMetric"].update(args[0])
    expected = {k: v.tolist() for k, v in metric.compute().items()}
    path = tmp_path / "metric.pt"
    path.write_bytes(pickle.dumps(metric))
    code = (
        "import pickle, sys, json; m = pickle.loads(open(sys.argv[1], 'rb').read());"
        " print(json.dumps({k: v.tolist() for k, v in m.compute().items()}));"
        " print(type(m['BinaryAUROC']).__mro__[1].__name__)"
    )
    out = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    values, mro = out.stdout.splitlines()
    assert json.loads(values) == expected and mro == "_StatesOnCPU"


def test_state_dict_and_load_keep_values():
    metric = store_states_on_cpu(CatMetric())
    metric.persistent(True)
    metric.update(torch.tensor([1.0, 2.0]))
    metric.update(torch.tensor([3.0]))
    state = metric.state_dict()
    other = store_states_on_cpu(CatMetric())
    other.persistent(True)
    other.load_state_dict(state)
    _assert_equal(other.compute(), torch.tensor([1.0, 2.0, 3.0]))


@pytest.mark.skipif(not hasattr(CatMetric, "merge_state"), reason="merge_state is torchmetrics >= 1.1")
def test_merge_state_keeps_values():
    left, right = store_states_on_cpu(CatMetric()), store_states_on_cpu(CatMetric())
    plain_left, plain_right = CatMetric(), CatMetric()
    for metric, value in ((left, [1.0]), (right, [2.0, 3.0]), (plain_left, [1.0]), (plain_right, [2.0, 3.0])):
        metric.update(torch.tensor(value))
    left.merge_state(right)
    plain_left.merge_state(plain_right)
    _assert_equal(left.compute(), plain_left.compute())  # the incoming state first, as torchmetrics does


# -- the non-blocking path, on the CPU: copies from a fake device land when the test says so


def _landed(metric):
    return [getattr(t, "landed", False) for t in metric.value]


def test_updates_start_copies_without_waiting_and_fold_them_in_order(fake_device):
    metric = store_states_on_cpu(CatMetric())
    for value in (1.0, 2.0, 3.0):
        metric.update(torch.tensor([value]))
    assert len(fake_device.copies) == 3 and not any(copy.waited for copy in fake_device.copies)
    assert _landed(metric) == [False, False, False]
    fake_device.copies[1].land()  # lands before the first: waits for it
    metric.update(torch.tensor([4.0]))
    assert _landed(metric) == [False, False, False, False]
    fake_device.copies[0].land()
    metric.update(torch.tensor([5.0]))
    assert _landed(metric) == [True, True, False, False, False]
    assert len(fake_device.copies) == 5  # each element is copied once
    _assert_equal(metric.compute(), torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0]))
    assert all(_landed(metric)) and all(copy.released for copy in fake_device.copies)


@pytest.mark.parametrize(
    "read",
    [
        lambda m: m.compute(),
        lambda m: m.state_dict(),
        lambda m: pickle.dumps(m),
        lambda m: copy.deepcopy(m),
        lambda m: ms._settle_states(m),
    ],
    ids=["compute", "state_dict", "pickle", "deepcopy", "report"],
)
def test_every_read_folds_what_is_in_flight_first(fake_device, read):
    metric = store_states_on_cpu(CatMetric())
    metric.update(torch.tensor([1.0]))
    metric.update(torch.tensor([2.0]))
    read(metric)
    assert _landed(metric) == [True, True] and all(copy.waited for copy in fake_device.copies)


def test_reset_does_not_wait_and_a_dropped_copy_touches_nothing(fake_device):
    metric = store_states_on_cpu(CatMetric())
    metric.update(torch.tensor([1.0]))
    metric.reset()  # `Running` resets its base Metric after every update: no wait there
    assert metric.value == [] and not fake_device.copies[0].waited
    metric.update(torch.tensor([2.0]))
    _assert_equal(metric.compute(), torch.tensor(2.0))
    assert _landed(metric) == [True] and all(copy.released for copy in fake_device.copies)


def test_forward_does_not_wait_and_keeps_the_order(fake_device):
    plain = CatMetric()
    metric = store_states_on_cpu(CatMetric())
    for value in (1.0, 2.0, 3.0):
        _assert_equal(plain(torch.tensor([value])), metric(torch.tensor([value])))
    assert not any(copy.waited for copy in fake_device.copies) and len(fake_device.copies) == 3
    fake_device.copies[0].land()
    _assert_equal(metric(torch.tensor([4.0])), torch.tensor(4.0))  # CatMetric squeezes a single value
    assert _landed(metric) == [True, False, False, False]
    _assert_equal(metric.compute(), torch.tensor([1.0, 2.0, 3.0, 4.0]))
    assert all(_landed(metric))


def test_module_moves_do_not_wait_for_copies(fake_device):
    metric = store_states_on_cpu(CatMetric())
    metric.update(torch.tensor([1.0]))
    metric.to("cpu")
    assert not fake_device.copies[0].waited
    _assert_equal(metric.compute(), torch.tensor(1.0))


def test_compute_groups_share_folded_states(fake_device):
    collection = store_states_on_cpu(
        MetricCollection([BinaryAUROC(thresholds=None), BinaryAveragePrecision(thresholds=None)])
    )
    plain = MetricCollection([BinaryAUROC(thresholds=None), BinaryAveragePrecision(thresholds=None)])
    for args, _ in _batches("binary"):
        collection.update(*args)
        plain.update(*args)
    assert collection.compute_groups == {0: ["BinaryAUROC", "BinaryAveragePrecision"]}
    got, expected = collection.compute(), plain.compute()
    for key in expected:
        _assert_equal(expected[key], got[key])
    for metric in collection.values(copy_state=False):
        assert all(getattr(t, "landed", False) for t in metric.preds)


# -- in a Trainer


class _AUROCModel(pl.LightningModule):
    def __init__(self, on_cpu: bool, use_forward: bool = False) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(3, 1)
        self.auroc = BinaryAUROC(thresholds=None)
        if on_cpu:
            store_states_on_cpu(self.auroc)
        self.use_forward = use_forward
        self.rows: list = []
        self.devices: set[str] = set()

    def validation_step(self, batch, batch_idx):
        preds = torch.sigmoid(self.layer(batch[0])).squeeze(-1)
        target = (batch[0][:, 0] > 0).long()
        if self.use_forward:
            self.auroc(preds, target)
        else:
            self.auroc.update(preds, target)
        self.log("val_auroc", self.auroc)
        self.devices.update(t.device.type for t in self.auroc.preds)
        self.rows = storage_report(self.trainer)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.parametrize("use_forward", [False, True])
def test_in_a_trainer_values_are_those_of_the_metric_on_its_device(quiet_trainer_kwargs, use_forward):
    results = []
    for on_cpu in (False, True):
        torch.manual_seed(0)
        model = _AUROCModel(on_cpu, use_forward)
        trainer = pl.Trainer(**quiet_trainer_kwargs)
        trainer.validate(model, loader(n=20), verbose=False)
        results.append((trainer.callback_metrics["val_auroc"], model))
    (plain, _), (value, model) = results
    _assert_equal(plain, value)
    assert model.devices == {"cpu"} and ms._stores_states_on_cpu(model.auroc)
    [row] = model.rows
    assert (row.kind, row.store_on_cpu, row.device, row.reduce_fx) == ("BinaryAUROC", True, "cpu", "compute")
    # 20 float32 predictions and int64 targets; after forward, the batch value (a float32 scalar) too
    assert row.bytes == 20 * (4 + 8) + (4 if use_forward else 0)
    assert "BinaryAUROC  True" in format_storage_report(model.rows)


# -- a real 2-process run on gloo


@pytest.fixture(scope="module")
def ddp_results(tmp_path_factory):
    """Both ranks' records of the scenarios in ``_metric_ddp_worker.py``, one process per rank."""
    return run_workers(WORKER, tmp_path_factory.mktemp("metric_ddp"))


@pytest.mark.distributed
def test_two_processes_give_the_values_of_the_metric_on_its_device(ddp_results):
    for rank, seen in enumerate(ddp_results):
        assert seen["checks"], rank
        for name, check in seen["checks"].items():
            assert check["ok"], (rank, name, check)


@pytest.mark.distributed
def test_two_processes_cover_every_case(ddp_results):
    assert sorted(ddp_results[0]["checks"]) == sorted(ddp_results[1]["checks"])
    assert {
        "gather_uneven_chunked",
        "gather_empty_rank",
        "gather_scalar",
        "gather_2d_chunked",
        "auroc_uneven",
        "auroc_empty_rank_chunked",
        "collection_compute_groups",
        "process_group",
        "dist_sync_on_step",
        "sync_on_compute_false",
        "spearman",
        "retrieval_map",
        "cat",
    } <= set(ddp_results[0]["checks"])


# -- CUDA (skipped without a GPU)


def _cuda_batches(n=8, size=64):
    generator = torch.Generator().manual_seed(0)
    return [
        (torch.rand(size, generator=generator), torch.randint(0, 2, (size,), generator=generator)) for _ in range(n)
    ]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_list_states_land_on_the_cpu_with_the_values_of_compute_on_cpu():
    reference = BinaryAUROC(thresholds=None, compute_on_cpu=True).cuda()
    metric = store_states_on_cpu(BinaryAUROC(thresholds=None)).cuda()
    for preds, target in _cuda_batches():
        reference.update(preds.cuda(), target.cuda())
        metric.update(preds.cuda(), target.cuda())
    _assert_equal(reference.compute(), metric.compute())
    assert metric.device.type == "cuda" and all(t.device.type == "cpu" for t in metric.preds + metric.target)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_update_makes_no_host_sync():
    metric = store_states_on_cpu(BinaryAUROC(thresholds=None)).cuda()
    batches = [(p.cuda(), t.cuda()) for p, t in _cuda_batches()]
    metric.update(*batches[0])  # the first update allocates the pinned pool
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for preds, target in batches[1:]:
            metric.update(preds, target)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    metric.compute()


class _CUDAModel(_AUROCModel):
    def validation_step(self, batch, batch_idx):
        super().validation_step(batch, batch_idx)
        self.device_bytes = getattr(self, "device_bytes", 0) + sum(
            t.numel() * t.element_size() for t in self.auroc.preds + self.auroc.target if t.is_cuda
        )


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_self_log_never_moves_list_states_back(quiet_trainer_kwargs):
    values = []
    for on_cpu in (False, True):
        torch.manual_seed(0)
        model = _CUDAModel(on_cpu)
        trainer = pl.Trainer(**{**quiet_trainer_kwargs, "accelerator": "gpu"})
        trainer.validate(model, loader(n=64), verbose=False)
        values.append(trainer.callback_metrics["val_auroc"].cpu())
        if on_cpu:
            [row] = model.rows
            assert (row.store_on_cpu, row.device) == (True, "cpu")
            assert model.auroc.device.type in ("cuda", "cpu")  # cpu after Lightning's teardown
    torch.testing.assert_close(values[0], values[1])  # computed on the GPU vs on the CPU: rounding may differ


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_nccl_sync_gathers_on_the_device_and_returns_to_the_cpu(tmp_path):
    if not torch.distributed.is_nccl_available():
        pytest.skip("needs NCCL")
    init = f"file://{tmp_path / 'store'}"
    torch.distributed.init_process_group("nccl", init_method=init, rank=0, world_size=1)
    try:
        metric = store_states_on_cpu(BinaryAUROC(thresholds=None), chunk_bytes=256).cuda()
        reference = BinaryAUROC(thresholds=None).cuda()
        for preds, target in _cuda_batches():
            metric.update(preds.cuda(), target.cuda())
            reference.update(preds.cuda(), target.cuda())
        torch.testing.assert_close(metric.compute(), reference.compute().cpu())
        gathered = gather_on_device(torch.arange(10.0), chunk_bytes=16)
        assert [g.device.type for g in gathered] == ["cpu"] and torch.equal(gathered[0], torch.arange(10.0))
    finally:
        torch.distributed.destroy_process_group()


def test_gather_on_device_checks_chunk_bytes():
    with pytest.raises(TypeError, match=r"Expected chunk_bytes to be an int, got True \(bool\)"):
        gather_on_device(torch.ones(1), chunk_bytes=True)


def test_the_partial_pickles():
    fn = pickle.loads(pickle.dumps(functools.partial(gather_on_device, chunk_bytes=8)))
    assert fn.func is gather_on_device
