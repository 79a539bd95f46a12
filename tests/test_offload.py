"""``offload_to_cpu`` in one process: the same values as the plain Metric on the CPU, bit for bit, off the caller."""

import copy
import pickle
import threading
import time

import pytest
import torch
from _metrics import ELEMENT_METRICS, WRAPPERS, assert_same_values, binary, flatten, run_wrapper
from torch import Tensor
from torchmetrics import CatMetric, MeanMetric, Metric, MetricCollection, SumMetric
from torchmetrics.classification import (
    BinaryAccuracy,
    BinaryAUROC,
    BinaryPrecision,
    BinaryRecall,
    MulticlassAccuracy,
    MulticlassConfusionMatrix,
    MulticlassPrecision,
)
from torchmetrics.utilities.data import dim_zero_cat
from torchmetrics.wrappers import BootStrapper, MetricTracker

from lightning_store import gather_on_device, offload_to_cpu, store_states_on_cpu
from lightning_store.metrics._offload.thread.worker import _thread_worker
from lightning_store.metrics._reads import _queue_of

pytestmark = pytest.mark.no_lightning  # no Lightning here: not run again on each Lightning minor (.ci/run)

GATE = threading.Event()  # held by `Gated.update`: closed, updates stay queued; a Metric must deep-copy, so not held


@pytest.fixture(autouse=True)
def _open_gate():
    GATE.set()
    yield
    GATE.set()


class Gated(Metric):
    """A tensor state and a list state; ``update`` waits for ``GATE``, so that a test can hold updates queued."""

    full_state_update = False

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.add_state("total", torch.tensor(0.0), dist_reduce_fx="sum", persistent=True)
        self.add_state("values", [], dist_reduce_fx="cat", persistent=True)

    def update(self, x: Tensor) -> None:
        GATE.wait()
        self.total += x.sum()
        self.values.append(x)

    def compute(self) -> Tensor:
        return self.total + (dim_zero_cat(self.values).sum() if self.values else 0)


def _batches(count=4, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [torch.rand(5, generator=generator) for _ in range(count)]


def _queued(metric, batches):
    """``metric`` after a first update run at once, then ``batches`` held queued behind the closed gate."""
    metric.update(torch.ones(5))
    metric.compute()
    GATE.clear()
    started = time.perf_counter()
    for batch in batches:
        metric.update(batch)
    assert time.perf_counter() - started < 1.0  # returned at once: nothing ran
    assert _queue_of(metric).pending == len(batches)
    threading.Timer(0.05, GATE.set).start()  # the read below waits for the gate, then for every update
    return metric


def _plain(batches):
    plain = Gated()
    for batch in [torch.ones(5), *batches]:
        plain.update(batch)
    return plain


READS = {
    "compute": lambda m: m.compute(),
    "forward": lambda m: (m(torch.full((5,), 2.0)), m.compute()),
    "reset": lambda m: (m.reset(), m.total, list(m.values), m.update_count)[1:],
    "state_dict": lambda m: m.state_dict(),
    "load_state_dict": lambda m: (
        m.load_state_dict({"total": torch.tensor(7.0), "values": [torch.ones(2)]}),
        m.compute(),
    )[1],
    "metric_state": lambda m: m.metric_state,
    "a state attribute": lambda m: (m.total, list(m.values)),
    "update_count": lambda m: torch.tensor(m.update_count),
    "pickle": lambda m: pickle.loads(pickle.dumps(m)).compute(),
    "deepcopy": lambda m: copy.deepcopy(m).compute(),
    "clone": lambda m: m.clone().compute(),
    "to float64": lambda m: (m.to(torch.float64), m.total, m.compute())[1:],
}


HAS_METRIC_STATE = hasattr(Metric, "metric_state")  # torchmetrics >= 1.1, as `merge_state`
NEEDS_MERGE_STATE = pytest.mark.skipif(not HAS_METRIC_STATE, reason="torchmetrics < 1.1 has no merge_state")


@pytest.mark.parametrize("read", READS)
def test_every_read_sees_every_earlier_update(read):
    if read == "metric_state" and not HAS_METRIC_STATE:
        pytest.skip("torchmetrics < 1.1 has no metric_state: the plain Metric has no such read")
    batches = _batches()
    metric = _queued(offload_to_cpu(Gated(), worker="thread"), batches)
    got = READS[read](metric)
    assert _queue_of(metric).pending == 0
    assert_same_values(got, READS[read](_plain(batches)))


@NEEDS_MERGE_STATE
def test_merge_state_sees_the_updates_of_both():
    batches = _batches()
    metric = _queued(offload_to_cpu(Gated(), worker="thread"), batches)
    other = offload_to_cpu(Gated(), worker="thread")
    other.update(torch.full((5,), 3.0))
    metric.merge_state(other)
    plain = _plain(batches)
    plain_other = Gated()
    plain_other.update(torch.full((5,), 3.0))
    plain.merge_state(plain_other)
    assert_same_values(metric.compute(), plain.compute())
    metric.merge_state(plain_other)  # a plain Metric of the same class merges too
    plain.merge_state(plain_other)
    assert_same_values(metric.compute(), plain.compute())


def test_update_takes_the_inputs_as_they_are_at_the_call():
    metric, plain = offload_to_cpu(CatMetric(), worker="thread"), CatMetric()
    x = torch.arange(5.0)
    metric.update(x)
    plain.update(x.clone())
    x.add_(100)  # after the call: the offloaded Metric must not see it
    assert_same_values(metric.compute(), plain.compute())


class SeesCollections(Metric):
    """Keeps its sentences and the sum of each tensor in its nested inputs, as they are when its update runs.

    With ``gated``, its update waits for ``GATE`` (in a worker thread: a worker process has a gate of its own).
    """

    def __init__(self, gated: bool = False):
        super().__init__()
        self.gated = gated
        self.add_state("seen", [], dist_reduce_fx="cat")

    def update(self, sentences: list[str], nested: dict[str, list[Tensor]]) -> None:
        if self.gated:
            GATE.wait()
        text = " | ".join(sentences) + f" ({len(nested['batch'])} tensors)"
        self.seen.append(torch.tensor(list(text.encode()), dtype=torch.uint8))
        self.seen.extend(t.sum().reshape(1) for t in nested["batch"])

    def compute(self) -> list[Tensor]:
        return list(self.seen)


@pytest.mark.parametrize("worker", ["thread", "process"])
def test_update_takes_lists_and_dicts_as_they_are_at_the_call(worker):
    metric = offload_to_cpu(SeesCollections(gated=worker == "thread"), worker=worker)
    plain = SeesCollections()
    metric.update(["warm", "up"], {"batch": []})
    plain.update(["warm", "up"], {"batch": []})
    metric.compute()
    GATE.clear()  # a worker thread holds the update below queued while the caller changes its inputs
    sentences, nested = ["the cat", "sat"], {"batch": [torch.ones(3), torch.arange(4.0)]}
    metric.update(sentences, nested)
    plain.update(list(sentences), {"batch": [t.clone() for t in nested["batch"]]})
    sentences[0] = "a dog"
    sentences.append("down")
    nested["batch"].append(torch.full((2,), 7.0))
    nested["batch"][0].add_(100)
    GATE.set()
    assert_same_values(metric.compute(), plain.compute())


def test_update_returns_at_once_and_the_worker_runs_the_updates_in_order():
    metric = offload_to_cpu(CatMetric(), max_pending=64, worker="thread")
    metric.update(torch.tensor([0.0]))
    metric.compute()
    gated = offload_to_cpu(Gated(), max_pending=64, worker="thread")
    gated.update(torch.ones(1))
    gated.compute()
    GATE.clear()
    gated.update(torch.ones(1))  # holds the worker: the updates below wait behind it, in order
    for i in range(1, 50):
        metric.update(torch.tensor([float(i)]))
    assert _queue_of(metric).pending == 49
    GATE.set()
    assert torch.equal(metric.compute(), torch.arange(50.0))


def test_every_state_lives_on_the_cpu_whatever_the_module_does():
    metric, plain = offload_to_cpu(BinaryAUROC(thresholds=None), worker="thread"), BinaryAUROC(thresholds=None)
    preds, target = binary(0, 50)
    metric.update(preds, target)
    plain.update(preds, target)
    metric.to("meta")  # a device that is not the CPU: the states stay, and so does the Metric's device
    metric.half()
    assert metric.device == torch.device("cpu")
    assert all(t.device.type == "cpu" for t in [*metric.preds, *metric.target])
    for m in (metric, plain):
        m.set_dtype(torch.float64)
    assert [t.dtype for t in metric.preds] == [t.dtype for t in plain.preds] == [torch.float64]
    assert_same_values(metric.compute(), plain.compute())


def test_dtype_conversions_follow_torchmetrics():
    metric, plain = (
        offload_to_cpu(MulticlassConfusionMatrix(num_classes=3), worker="thread"),
        MulticlassConfusionMatrix(num_classes=3),
    )
    for m in (metric, plain):
        m.update(torch.tensor([0, 1, 2, 2]), torch.tensor([0, 2, 2, 1]))
    for convert in (lambda m: m.to(torch.float64), lambda m: m.half(), lambda m: m.set_dtype(torch.float16)):
        convert(metric)
        convert(plain)
        assert metric.confmat.dtype == plain.confmat.dtype
        assert_same_values(metric.compute(), plain.compute())


WORKERS = pytest.mark.parametrize("worker", ["thread", "process"])


@WORKERS
@pytest.mark.parametrize("name", sorted(set(WRAPPERS) - {"BootStrapper"}))
def test_wrappers_and_collections_give_the_plain_values(name, worker):
    make, _ = WRAPPERS[name]
    batches = [(seed, 6) for seed in range(4)]
    offloaded = offload_to_cpu(make(), worker=worker)
    assert_same_values(run_wrapper(name, offloaded, batches), run_wrapper(name, make(), batches))
    assert all(
        t.device.type == "cpu"
        for m in offloaded.modules()
        if isinstance(m, Metric)
        for t in flatten([getattr(m, name) for name in m._defaults])
    )


@WORKERS
@pytest.mark.parametrize("name", sorted(ELEMENT_METRICS))
def test_metrics_keeping_one_element_per_item_give_the_plain_values(name, worker):
    make, data = ELEMENT_METRICS[name]
    offloaded, plain = offload_to_cpu(make(), worker=worker), make()
    for seed in range(3):
        items = data(seed, 4)
        offloaded.update(items)
        plain.update([t.clone() for t in items])
    assert_same_values(offloaded.compute(), plain.compute())


def test_a_collection_with_compute_groups_updates_once_and_gives_the_plain_values():
    def make():
        return MetricCollection([BinaryAccuracy(), BinaryPrecision(), BinaryRecall()])

    offloaded, plain = offload_to_cpu(make(), worker="thread"), make()
    for seed in range(4):
        preds, target = binary(seed, 20)
        assert_same_values(offloaded(preds, target), plain(preds, target))
        offloaded.update(preds, target)
        plain.update(preds, target)
    assert offloaded.compute_groups == plain.compute_groups
    assert_same_values(offloaded.compute(), plain.compute())
    assert _queue_of(offloaded) is _queue_of(offloaded["BinaryAccuracy"])  # one queue for all


def _three_classes(seed: int) -> tuple[Tensor, Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return torch.rand(10, 3, generator=generator).softmax(-1), torch.randint(3, (10,), generator=generator)


class Pair(Metric):
    def __init__(self):
        super().__init__()
        self.add_state("total", torch.tensor(0.0), dist_reduce_fx="sum")

    def update(self, preds: Tensor, target: Tensor) -> None:
        self.total += preds.sum()

    def compute(self) -> Tensor:
        return self.total


class GatedPair(Pair):
    def update(self, preds: Tensor, target: Tensor) -> None:
        GATE.wait()
        super().update(preds, target)


def _grouped(pair: type) -> MetricCollection:
    # accuracy and precision share their states (a compute group); `GatedPair` holds the queue when the test says
    return MetricCollection(
        {"acc": MulticlassAccuracy(3), "prec": MulticlassPrecision(3), "pair": pair()}, compute_groups=True
    )


@pytest.mark.parametrize("read", ["keys", "items", "values"])
def test_a_collections_metrics_read_while_updates_are_queued_see_them(read):
    offloaded, plain = offload_to_cpu(_grouped(GatedPair), worker="thread"), _grouped(Pair)
    for epoch in range(2):  # reset between epochs: a state still shared by reference would leak into the next
        for step in range(2):
            preds, target = _three_classes(10 * epoch + step)
            plain.update(preds, target)
            if epoch or step:
                GATE.clear()  # the first update forms the groups, at once; the others stay queued
            offloaded.update(preds, target)
        assert _queue_of(offloaded).pending > 0
        threading.Timer(0.05, GATE.set).start()
        pairs = {  # as torchmetrics' own test: each Metric read, then reset, before the next is read
            "keys": lambda: ((offloaded[key], plain[key]) for key in plain),
            "items": lambda: ((a, b) for (_, a), (_, b) in zip(offloaded.items(), plain.items(), strict=True)),
            "values": lambda: zip(offloaded.values(), plain.values(), strict=True),
        }[read]()
        for got, expected in pairs:
            for state in expected._defaults:
                assert_same_values(getattr(got, state), getattr(expected, state))
            assert_same_values(got.compute(), expected.compute())
            got.reset()
            expected.reset()
    assert offloaded.compute_groups == plain.compute_groups == {0: ["acc", "prec"], 1: ["pair"]}


def test_a_tracker_offloads_the_copies_it_makes():
    tracker = offload_to_cpu(MetricTracker(MeanMetric(), maximize=True), worker="thread")
    plain = MetricTracker(MeanMetric(), maximize=True)
    for epoch in range(3):
        for t in (tracker, plain):
            t.increment()
        for x in _batches(3, seed=epoch):
            tracker.update(x)
            plain.update(x)
        assert_same_values(tracker.compute(), plain.compute())
    assert_same_values(tracker.compute_all(), plain.compute_all())
    assert _queue_of(tracker[-1]) is _queue_of(tracker)


class Fails(Metric):
    def __init__(self):
        super().__init__()
        self.add_state("total", torch.tensor(0.0), dist_reduce_fx="sum")

    def update(self, x: Tensor) -> None:
        GATE.wait()
        if x.sum() < 0:
            raise ValueError("Expected non-negative values")
        self.total += x.sum()

    def compute(self) -> Tensor:
        return self.total


class _OwnError(Exception):
    def __init__(self, code: int, detail: str) -> None:
        super().__init__(code, detail)


class FailsOwnWay(Fails):
    def update(self, x: Tensor) -> None:
        if self.total > 0:
            raise _OwnError(3, "no")
        super().update(x)


def test_an_update_that_raises_in_the_worker_raises_at_the_next_call_with_its_type_name_and_number():
    metric = offload_to_cpu(Fails(), worker="thread")
    metric.update(torch.ones(2))
    GATE.clear()  # the worker holds at the failing update: the two after it are queued before it raises
    for x in (-torch.ones(2), torch.ones(2), torch.ones(2)):
        metric.update(x)
    GATE.set()
    with pytest.raises(
        ValueError, match=r"^Fails.update raised in lightning-store's offload worker, at update #2"
    ) as err:
        metric.compute()
    message = str(err.value)
    assert "Expected non-negative values" in message
    assert "The 2 update(s) queued after it were not run" in message
    assert isinstance(err.value.__cause__, ValueError) and str(err.value.__cause__) == "Expected non-negative values"
    assert err.value.__cause__.__traceback__ is not None  # the worker's traceback, chained
    # the state is the plain one after a failed update, and new updates run again
    plain = Fails()
    plain.update(torch.ones(2))
    with pytest.raises(ValueError):
        plain.update(-torch.ones(2))
    assert_same_values((metric.compute(), metric.update_count), (plain.compute(), plain.update_count))
    metric.update(torch.ones(2))
    plain.update(torch.ones(2))
    assert_same_values(metric.compute(), plain.compute())


@pytest.mark.parametrize("call", ["update", "reset", "a state attribute"])
def test_the_error_raises_from_any_next_call(call):
    metric = offload_to_cpu(Fails(), worker="thread")
    metric.update(torch.ones(2))
    metric.update(-torch.ones(2))
    _thread_worker().quiesce()  # it has raised in the worker
    with pytest.raises(ValueError, match="at update #2"):
        {
            "update": lambda: metric.update(torch.ones(2)),
            "reset": metric.reset,
            "a state attribute": lambda: metric.total,
        }[call]()
    assert metric.compute() == 2.0  # raised once; the update refused with it was not queued


def test_an_error_of_a_class_with_other_arguments_raises_as_it_was():
    metric = offload_to_cpu(FailsOwnWay(), worker="thread")
    metric.update(torch.ones(2))
    metric.update(torch.ones(2))
    with pytest.raises(_OwnError) as err:
        metric.compute()
    assert err.value.args == (3, "no")


def test_the_first_update_raises_at_the_next_call_as_any_other():
    metric, plain = offload_to_cpu(Fails(), worker="thread"), Fails()
    metric.update(-torch.ones(2))  # queued: it raises in the worker
    with pytest.raises(ValueError, match=r"^Expected non-negative values$"):
        plain.update(-torch.ones(2))
    with pytest.raises(ValueError, match=r"at update #1 since offload_to_cpu: Expected non-negative values\. The"):
        metric.compute()
    assert metric.update_count == plain.update_count == 1  # torchmetrics counts a failed update
    for m in (metric, plain):
        m.update(torch.ones(2))
    assert_same_values(metric.compute(), plain.compute())


def test_backpressure_bounds_the_pending_updates_and_counts_the_wait():
    metric = offload_to_cpu(Gated(), max_pending=2, worker="thread")
    metric.update(torch.ones(1))
    metric.compute()
    GATE.clear()
    threading.Timer(0.2, GATE.set).start()
    started = time.perf_counter()
    for _ in range(4):
        metric.update(torch.ones(1))
        assert _queue_of(metric).pending <= 2
    waited = time.perf_counter() - started
    queue = _queue_of(metric)
    assert queue.waits >= 1 and 0 < queue.waited_s <= waited + 0.01
    assert metric.compute() == 2 * 5  # (1 + 1) per update: its sum and its element


@pytest.mark.parametrize(
    ("value", "error", "message"),
    [
        ("8", TypeError, "Expected max_pending to be an int, got '8' (str)."),
        (True, TypeError, "Expected max_pending to be an int, got True (bool)."),
        (2.0, TypeError, "Expected max_pending to be an int, got 2.0 (float)."),
        (0, ValueError, "Expected max_pending to be positive, got 0."),
        (-1, ValueError, "Expected max_pending to be positive, got -1."),
    ],
)
def test_max_pending_is_validated(value, error, message):
    with pytest.raises(error, match=f"^{message.replace('(', '[(]').replace(')', '[)]')} HINT: pass a number"):
        offload_to_cpu(MeanMetric(), max_pending=value, worker="thread")


def test_calling_it_again_sets_max_pending():
    metric = offload_to_cpu(MeanMetric(), worker="thread")
    assert offload_to_cpu(metric, max_pending=3, worker="thread") is metric and _queue_of(metric).max_pending == 3


def test_bootstrapper_is_refused_at_once():
    with pytest.raises(ValueError, match=r"^offload_to_cpu\(\) got a BootStrapper: its update draws random numbers"):
        offload_to_cpu(BootStrapper(MeanMetric()), worker="thread")
    with pytest.raises(ValueError, match=r"got a BootStrapper \(inside the MetricCollection given\)"):
        offload_to_cpu(MetricCollection({"boot": BootStrapper(MeanMetric())}), worker="thread")


def test_what_cannot_be_offloaded_is_refused_with_a_hint():
    with pytest.raises(TypeError, match=r"^offload_to_cpu\(\) got the class BinaryAUROC itself.*HINT: call the class"):
        offload_to_cpu(BinaryAUROC, worker="thread")
    with pytest.raises(
        TypeError, match=r"^offload_to_cpu\(\) takes a torchmetrics Metric.*got torch.nn.modules.linear.Linear. HINT"
    ):
        offload_to_cpu(torch.nn.Linear(1, 1), worker="thread")
    with pytest.raises(ValueError, match=r"given to store_states_on_cpu.*HINT: drop store_states_on_cpu"):
        offload_to_cpu(store_states_on_cpu(BinaryAUROC(thresholds=None)), worker="thread")
    with pytest.raises(ValueError, match=r"with dist_sync_fn=.*HINT: drop dist_sync_fn"):
        offload_to_cpu(MeanMetric(dist_sync_fn=lambda t, group=None: [t]), worker="thread")
    inner = offload_to_cpu(MeanMetric(), worker="thread")
    with pytest.raises(ValueError, match=r"holding a MeanMetric offloaded on its own.*HINT: offload only"):
        offload_to_cpu(MetricCollection({"mean": inner}), worker="thread")


def test_store_states_on_cpu_leaves_an_offloaded_metric_as_it_is():
    metric = offload_to_cpu(BinaryAUROC(thresholds=None), worker="thread")
    assert store_states_on_cpu(metric) is metric
    assert type(metric).__mro__[1].__name__ == "_OffloadedMetric"
    assert metric.dist_sync_fn is gather_on_device


def test_one_worker_thread_runs_every_offloaded_metric():
    metrics = [offload_to_cpu(MeanMetric(), worker="thread") for _ in range(5)]
    for m in metrics:
        m.update(torch.tensor(1.0))
    assert [m.compute() for m in metrics] == [1.0] * 5
    names = [t.name for t in threading.enumerate() if t.name == "lightning-store-offload"]
    assert names == ["lightning-store-offload"] and _thread_worker().thread.daemon


def test_torchscript_scripts_the_offloaded_metric_as_the_plain_one():
    metric, plain = offload_to_cpu(BinaryAccuracy(), worker="thread"), BinaryAccuracy()
    preds, target = binary(0, 20)
    metric.update(preds, target)
    plain.update(preds, target)
    scripted, scripted_plain = torch.jit.script(metric), torch.jit.script(plain)
    assert torch.equal(scripted.tp, scripted_plain.tp)  # the states as they were, every update landed


def test_the_worker_runs_an_update_with_the_callers_number_of_torch_threads():
    x = torch.randn(4_000_000, generator=torch.Generator().manual_seed(0))  # large enough to split a sum
    offloaded, plain = offload_to_cpu(SumMetric(), worker="thread"), SumMetric()
    threads = torch.get_num_threads()
    try:
        for count in (threads, 1, threads):  # as Lightning's DDP launcher sets it when the fit starts
            torch.set_num_threads(count)
            for m in (offloaded, plain):
                m.update(x)
            assert_same_values(offloaded.compute(), plain.compute())
    finally:
        torch.set_num_threads(threads)


def test_an_update_runs_in_the_callers_inference_mode():
    metric, plain = offload_to_cpu(SumMetric(), worker="thread"), SumMetric()
    with torch.inference_mode():  # as Lightning's evaluation loops: a state reset here is an inference tensor
        for m in (metric, plain):
            m.update(torch.tensor(1.0))
            m.reset()
            m.update(torch.tensor(2.0))  # changes it in place: only inference mode may
            m.update(torch.tensor(3.0))
        assert_same_values(metric.compute(), plain.compute())


def test_walking_a_modules_children_does_not_wait_for_the_queue():
    model = torch.nn.Module()
    model.metric = offload_to_cpu(Gated(), worker="thread")
    model.metric.update(torch.ones(5))
    model.metric.compute()
    GATE.clear()
    model.metric.update(torch.ones(5))  # held queued
    assert [name for name, _ in model.named_modules()] == ["", "metric"]  # torchmetrics' hash reads the states
    list(model.parameters())
    model.train()
    assert _queue_of(model.metric).pending == 1
    GATE.set()
    assert model.metric.compute() == 2 * 10
    assert len({model.metric, offload_to_cpu(Gated(), worker="thread")}) == 2


def test_a_setting_changed_while_updates_are_queued_applies_after_them_as_in_the_plain_metric():
    class GatedCat(CatMetric):
        def update(self, value: Tensor) -> None:
            GATE.wait()
            super().update(value)

    metric, plain = offload_to_cpu(GatedCat(nan_strategy="ignore"), worker="thread"), CatMetric(nan_strategy="ignore")
    nan = torch.tensor([1.0, float("nan")])
    GATE.clear()
    metric.update(nan)  # queued: it must run with the strategy of its call
    plain.update(nan)
    threading.Timer(0.05, GATE.set).start()
    for m in (metric, plain):
        m.nan_strategy = 0.0
        m.update(nan)
    assert_same_values(metric.compute(), plain.compute())


@pytest.mark.parametrize("worker", [None, "thread", "process"])
def test_a_state_tensor_held_follows_later_updates_but_with_a_worker_process(worker):
    """The plain Metric updates a state in place: the tensor given to ``load_state_dict``, or read, follows."""
    metric = SumMetric() if worker is None else offload_to_cpu(SumMetric(), worker=worker)
    metric.persistent(True)
    (state,) = metric._defaults  # its one state: `sum_value` (`value` before torchmetrics 1.1)
    loaded = torch.tensor(0.0)
    metric.load_state_dict({state: loaded})
    metric.update(torch.tensor(2.0))
    read = getattr(metric, state)  # a read: it waits for the update
    metric.update(torch.tensor(3.0))
    assert metric.compute() == 5.0 and getattr(metric, state) == 5.0
    if worker == "process":  # the updates ran on the worker process's copy: each read gives the states anew
        assert (loaded.item(), read.item()) == (0.0, 2.0)
    else:
        assert (loaded.item(), read.item()) == (5.0, 5.0)


def test_the_worker_process_runs_the_update_the_offloaded_metric_queues():
    import functools

    from lightning_store.metrics._offload.front import _queued_update

    metric = offload_to_cpu(SumMetric(), worker="process")
    queued = _queued_update(metric.update)
    assert queued is not metric.update and queued.__wrapped__.__func__ is SumMetric.update  # torchmetrics' wrapper

    @functools.wraps(metric.update)  # copies the wrapper's attributes: still a wrapper of its own
    def wrapping(*args, **kwargs):
        return metric.update(*args, **kwargs)

    assert _queued_update(wrapping) is wrapping
    plain = SumMetric()
    assert _queued_update(plain.update) is plain.update
    metric.update(torch.tensor([1.0, 2.5]))
    assert metric.compute() == 3.5


def test_max_pending_defaults_by_worker():
    assert _queue_of(offload_to_cpu(MeanMetric())).max_pending == 64  # inputs wait in shared memory of its own size
    assert _queue_of(offload_to_cpu(MeanMetric(), worker="thread")).max_pending == 16  # each holds a copy
    metric = offload_to_cpu(MeanMetric(), worker="thread", max_pending=3)
    assert _queue_of(offload_to_cpu(metric, worker="thread")).max_pending == 16  # given again: the default again
    with pytest.raises(TypeError, match=r"HINT: pass a number of updates, such as max_pending=64 \(worker='process'"):
        offload_to_cpu(MeanMetric(), max_pending=2.0)  # type: ignore[arg-type]
