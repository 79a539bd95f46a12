"""``offload_to_cpu(worker="process")``: the plain Metric's values, bit for bit, from a copy in a worker process."""

import copy
import os
import pickle
import random
import re
import time
import warnings

import numpy as np
import pytest
import torch
from _metrics import (
    DRAWS,
    DrawsOnLargeBatches,
    Gram,
    SeesLayout,
    SeesWaitPolicy,
    assert_same_values,
    binary,
)
from torch import Tensor
from torchmetrics import CatMetric, MeanMetric, MetricCollection, SumMetric
from torchmetrics.classification import BinaryAUROC, MulticlassAccuracy, MulticlassPrecision
from torchmetrics.wrappers import MetricTracker

from lightning_store import offload_to_cpu
from lightning_store.metrics._offload.process.parent import _process_worker
from lightning_store.metrics._reads import _queue_of

pytestmark = pytest.mark.no_lightning  # no Lightning here: not run again on each Lightning minor (.ci/run)


def _pair(make):
    return offload_to_cpu(make(), worker="process"), make()


def _batches(count=4, size=50, seed=0):
    return [binary(seed + i, size) for i in range(count)]


READS = {
    "compute": lambda m: m.compute(),
    "a state attribute": lambda m: (list(m.preds), list(m.target)),
    "update_count": lambda m: torch.tensor(m.update_count),
    "state_dict": lambda m: m.state_dict(),
    "forward, then compute": lambda m: (m(*binary(99, 10)), m.compute()),
    "reset, then an update": lambda m: (m.reset(), m.update(*binary(98, 10)), m.compute())[2],
    "load_state_dict, then an update": lambda m: (
        m.load_state_dict({"preds": [torch.linspace(0, 1, 3)], "target": [torch.ones(3, dtype=torch.long)]}),
        m.update(*binary(97, 10)),
        m.compute(),
    )[2],
    "pickle": lambda m: pickle.loads(pickle.dumps(m)).compute(),
    "deepcopy": lambda m: copy.deepcopy(m).compute(),
    "clone, then an update of each": lambda m: _updated_both(m, m.clone()),
    "to float64": lambda m: (m.to(torch.float64), [t.dtype for t in m.preds], m.compute())[1:],
}


def _updated_both(a, b):
    a.update(*binary(96, 10))
    b.update(*binary(95, 10))
    return a.compute(), b.compute()


@pytest.mark.parametrize("read", READS)
def test_every_read_sees_every_earlier_update_and_what_it_changes_reaches_the_worker(read):
    offloaded, plain = _pair(lambda: BinaryAUROC(thresholds=None))
    for batch in _batches():
        offloaded.update(*batch)
        plain.update(*batch)
    assert_same_values(READS[read](offloaded), READS[read](plain))
    offloaded.update(*binary(50, 10))  # after the read, the worker process gets the object again
    plain.update(*binary(50, 10))
    assert_same_values(offloaded.compute(), plain.compute())
    assert all(t.is_cpu for t in offloaded.preds)


def test_a_collection_with_compute_groups_read_member_by_member_as_torchmetrics_tests_it():
    def make():
        return MetricCollection({"acc": MulticlassAccuracy(3), "prec": MulticlassPrecision(3)}, compute_groups=True)

    offloaded, plain = _pair(make)
    generator = torch.Generator().manual_seed(0)
    for _ in range(2):
        for _ in range(2):
            preds, target = torch.rand(10, 3, generator=generator), torch.randint(3, (10,), generator=generator)
            offloaded.update(preds, target)
            plain.update(preds, target)
        for key in plain:  # each Metric read, then reset, before the next is read
            got, expected = offloaded[key], plain[key]
            assert_same_values(got.compute(), expected.compute())
            got.reset()
            expected.reset()
    assert offloaded.compute_groups == plain.compute_groups == {0: ["acc", "prec"]}


def test_a_tracker_sends_the_copies_it_makes():
    offloaded, plain = _pair(lambda: MetricTracker(MeanMetric(), maximize=True))
    generator = torch.Generator().manual_seed(1)
    for _ in range(3):
        for t in (offloaded, plain):
            t.increment()
        for _ in range(3):
            x = torch.rand(5, generator=generator)
            offloaded.update(x)
            plain.update(x)
        assert_same_values(offloaded.compute(), plain.compute())
    assert_same_values(offloaded.compute_all(), plain.compute_all())


def test_a_setting_changed_here_reaches_the_worker():
    offloaded, plain = _pair(lambda: CatMetric(nan_strategy="ignore"))
    nan = torch.tensor([1.0, float("nan")])
    for m in (offloaded, plain):
        m.update(nan)
        m.nan_strategy = 0.0  # from now on, a NaN becomes 0
        m.update(nan)
    assert_same_values(offloaded.compute(), plain.compute())


@pytest.mark.parametrize(
    "make",
    [lambda: torch.randn(40, 64)[:, ::2], lambda: torch.randn(33, 64).T, lambda: torch.randn(1, 8).expand(5, 8)],
    ids=["every other column", "transposed", "expanded"],
)
def test_the_metric_sees_the_layout_the_caller_passed(make):
    offloaded, plain = _pair(SeesLayout)
    for _ in range(2):
        x = make()
        offloaded.update(x)
        plain.update(x)
    assert_same_values(offloaded.compute(), plain.compute())


@pytest.mark.parametrize(
    "context",
    [
        lambda: torch.autocast("cpu", dtype=torch.bfloat16),
        torch.inference_mode,
        lambda: _default_dtype(torch.float64),
    ],
    ids=["cpu autocast", "inference mode", "another default dtype"],
)
def test_an_update_runs_with_the_callers_torch_state(context):
    offloaded, plain = _pair(Gram)
    generator = torch.Generator().manual_seed(2)
    for _ in range(3):
        x = torch.randn(16, 4, generator=generator)
        with context():
            offloaded.update(x)
            plain.update(x)
    assert_same_values(offloaded.compute(), plain.compute())


class _default_dtype:
    def __init__(self, dtype):
        self.dtype, self.before = dtype, torch.get_default_dtype()

    def __enter__(self):
        torch.set_default_dtype(self.dtype)

    def __exit__(self, *exc):
        torch.set_default_dtype(self.before)


class AddsATensor(SumMetric):
    """Adds a tensor made with the default dtype: its value depends on it."""

    def update(self, value: Tensor) -> None:
        super().update(value + torch.tensor(1 / 3))


def test_the_default_dtype_at_the_call_is_the_one_the_update_runs_with():
    offloaded, plain = _pair(AddsATensor)
    for m in (offloaded, plain):
        with _default_dtype(torch.float64):
            m.update(torch.ones(2, dtype=torch.float64))
    assert_same_values(offloaded.compute(), plain.compute())


class Fails(SumMetric):
    def update(self, value: Tensor) -> None:
        if value.sum() < 0:
            time.sleep(0.5)  # the updates called after it are queued before its answer comes back
            raise ValueError("Expected non-negative values")
        super().update(value)


def test_an_update_that_raises_there_raises_at_the_next_call_with_the_plain_state():
    offloaded, plain = _pair(Fails)
    for m in (offloaded, plain):
        m.update(torch.ones(2))
    with pytest.raises(ValueError, match="Expected non-negative values"):
        plain.update(-torch.ones(2))
    for x in (-torch.ones(2), torch.ones(2), torch.ones(2)):
        offloaded.update(x)
    with pytest.raises(
        ValueError, match=r"^Fails.update raised in lightning-store's offload worker, at update #2"
    ) as err:
        offloaded.compute()
    assert "The 2 update(s) queued after it were not run" in str(err.value)
    assert isinstance(err.value.__cause__, ValueError)
    assert "Traceback" in str(err.value.__cause__.__cause__)  # the worker process's traceback
    assert_same_values((offloaded.compute(), offloaded.update_count), (plain.compute(), plain.update_count))
    for m in (offloaded, plain):
        m.update(torch.ones(2))  # new updates run again
    assert_same_values(offloaded.compute(), plain.compute())


def test_a_warning_there_is_given_again_here_once():
    offloaded = offload_to_cpu(CatMetric(nan_strategy="warn"), worker="process")
    offloaded.update(torch.tensor([1.0, float("nan")]))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        offloaded.compute()
    assert [w.category for w in caught] == [UserWarning]
    assert "values in tensor" in str(caught[0].message)
    assert str(caught[0].message).endswith(
        "(given by CatMetric.update #1, which ran in lightning-store's offload worker)"
    )
    assert caught[0].filename == __file__


@pytest.mark.parametrize("generator", DRAWS)
def test_a_draw_there_fails_the_update_and_moves_nothing_here(generator):
    offloaded = offload_to_cpu(DrawsOnLargeBatches(generator), worker="process")
    states = (torch.get_rng_state(), random.getstate(), np.random.get_state()[1].copy())
    offloaded.update(torch.ones(2))
    offloaded.update(torch.ones(8))
    with pytest.raises(
        RuntimeError, match=f"at update #2 since offload_to_cpu: it drew random numbers from {generator}"
    ):
        offloaded.compute()
    assert torch.equal(torch.get_rng_state(), states[0]) and random.getstate() == states[1]
    assert np.array_equal(np.random.get_state()[1], states[2])


class DrawsAfterAWait(DrawsOnLargeBatches):
    """Waits in an update of 3 values: the calls after it are held here, and go to the worker process together."""

    def update(self, value: Tensor) -> None:
        if value.numel() == 3:
            time.sleep(0.5)
        super().update(value)


@pytest.mark.parametrize("generator", DRAWS)
def test_a_draw_in_updates_run_in_a_row_is_said_of_them(generator):
    offloaded = offload_to_cpu(DrawsAfterAWait(generator), worker="process", max_pending=8)
    states = (torch.get_rng_state(), random.getstate(), np.random.get_state()[1].copy())
    for size in (3, 2, 2, 8, 2, 2, 2, 2):  # update #4 draws
        offloaded.update(torch.ones(size))
    with pytest.raises(RuntimeError) as err:
        offloaded.compute()
    found = re.match(
        r"DrawsAfterAWait\.update raised in lightning-store's offload worker, in one of updates #(\d) to #(\d) since"
        r" offload_to_cpu \(run in a row there, and checked together\): it drew random numbers from (.+) global"
        r" generator in the worker process\..* The Metric's state holds what the updates changed, draws included\."
        r" The (\d) update\(s\) queued after it were not run",
        str(err.value),
    )
    assert found is not None, str(err.value)
    first, last, drawn, not_run = int(found[1]), int(found[2]), found[3], int(found[4])
    assert 1 <= first < last and first <= 4 <= last and not_run == 8 - last and drawn == generator
    assert torch.equal(torch.get_rng_state(), states[0]) and random.getstate() == states[1]
    assert np.array_equal(np.random.get_state()[1], states[2])
    offloaded.reset()  # and it runs updates again
    offloaded.update(torch.ones(2))
    assert offloaded.compute() == 2.0


class DrawsWhenUnpickled(SumMetric):
    """Draws from every generator when a copy of it is made (in the worker process, before the next update)."""

    def __setstate__(self, state):
        super().__setstate__(state)
        for draw in DRAWS.values():
            draw()


def test_a_draw_between_two_updates_is_not_taken_for_the_second_updates():
    offloaded, plain = _pair(DrawsWhenUnpickled)
    for value in torch.arange(6.0).split(2):  # a read between updates: the copy sent again draws, the update not
        offloaded.update(value)
        plain.update(value)
        assert torch.equal(offloaded.compute(), plain.compute())


class Unpicklable(SumMetric):
    def __init__(self):
        super().__init__()
        self.transform = lambda x: x


def test_the_default_worker_is_a_process_and_gives_the_plain_values():
    offloaded, plain = offload_to_cpu(MeanMetric()), MeanMetric()
    assert _queue_of(offloaded).worker == "process"
    for value in torch.linspace(-1.0, 3.0, 20).split(3):
        offloaded.update(value)
        plain.update(value)
    assert torch.equal(offloaded.compute(), plain.compute())
    assert _process_worker().process is not None and _process_worker().process.is_alive()


def test_what_a_worker_process_cannot_take_is_refused_with_a_hint():
    with pytest.raises(
        TypeError, match=r"^offload_to_cpu\(worker='process'\) got a Unpicklable that cannot be pickled"
    ):
        offload_to_cpu(Unpicklable(), worker="process")
    with pytest.raises(ValueError, match=r"^Expected worker to be 'process' or 'thread', got 'threads'\. HINT"):
        offload_to_cpu(SumMetric(), worker="threads")  # type: ignore[arg-type]
    metric = offload_to_cpu(SumMetric(), worker="thread")
    with pytest.raises(ValueError, match=r"offloaded already with worker='thread'.*HINT: pass worker='thread'"):
        offload_to_cpu(metric, worker="process")


def test_a_worker_process_that_ends_is_said_and_reset_goes_on():
    offloaded = offload_to_cpu(SumMetric(), worker="process")
    offloaded.update(torch.ones(2))
    offloaded.compute()
    offloaded.update(torch.ones(2))  # run there, not read back
    _process_worker().flush()
    _process_worker().process.kill()
    _process_worker().process.join(10)
    state = next(iter(offloaded._defaults))  # `sum_value` (torchmetrics >= 1.1) or `value`
    for read in (lambda: offloaded.compute(), lambda: offloaded.update_count, lambda: getattr(offloaded, state)):
        with pytest.raises(RuntimeError, match=r"^SumMetric: lightning-store's offload worker process ended"):
            read()  # every read says so, until `reset()`
    offloaded.reset()
    assert _queue_of(offloaded).lost is None
    offloaded.update(torch.ones(3))
    assert offloaded.compute() == 3.0  # a new worker process


def test_an_unpickled_collection_sends_itself_whole_and_goes_on():
    def make():
        return MetricCollection({"acc": MulticlassAccuracy(3), "prec": MulticlassPrecision(3)})

    offloaded, plain = _pair(make)
    generator = torch.Generator().manual_seed(3)
    batches = [(torch.rand(10, 3, generator=generator), torch.randint(3, (10,), generator=generator)) for _ in range(4)]
    for batch in batches[:2]:
        offloaded.update(*batch)
        plain.update(*batch)
    copied = pickle.loads(pickle.dumps(offloaded))
    assert _queue_of(copied["acc"]) is _queue_of(copied) and _queue_of(copied).root is copied
    for batch in batches[2:]:
        copied["prec"].update(*batch)  # a Metric of the collection, alone
        plain["prec"].update(*batch)
    assert_same_values(copied["prec"].compute(), plain["prec"].compute())


def test_inputs_whose_copies_land_late_are_sent_once_landed_in_order(monkeypatch):
    """As CUDA inputs: copied without a host sync, written into the arena and sent when the copy has landed."""
    from _support import ManualTransfer

    from lightning_store.metrics._offload.process import inputs as _inputs_shared

    transfer = ManualTransfer()
    monkeypatch.setattr(_inputs_shared, "_transfer_for", lambda device: transfer)
    offloaded, plain = _pair(CatMetric)
    for value in range(3):
        x = torch.full((4,), float(value))
        offloaded.update(x)
        plain.update(x.clone())
        x.add_(100)  # after the call: the copy holds the value at the call
    assert len(_process_worker().outbox) == 3  # none landed: none sent
    transfer.copies[0].land()
    _process_worker().flush(wait=False)
    assert len(_process_worker().outbox) == 2 and not transfer.copies[1].waited  # the first went, in order
    assert_same_values(offloaded.compute(), plain.compute())  # a read waits for every copy
    assert all(c.waited and c.released for c in transfer.copies[1:])


class SeesItsState(CatMetric):
    """Keeps, by update, whether grad mode was on and the default dtype's tensor of its input's sum."""

    def update(self, value: Tensor) -> None:
        super().update(torch.tensor([float(torch.is_grad_enabled()), value.sum().item()]))


def _updates_per_message(monkeypatch):
    """The number of updates in each message sent to the worker process, as sent."""
    from lightning_store.metrics._offload.process import messages
    from lightning_store.metrics._offload.process.parent import _ProcessWorker

    counts, send_bytes = [], _ProcessWorker.send_bytes

    def counted(self, payload, start=False):
        message = messages._read(pickle.loads(payload))
        if isinstance(message, messages._Updates):
            counts.append(len(message.updates))
        send_bytes(self, payload, start)

    monkeypatch.setattr(_ProcessWorker, "send_bytes", counted)
    return counts


@pytest.mark.filterwarnings("ignore:.*falls behind")  # back to back on purpose: the calls wait for the worker
@pytest.mark.filterwarnings("ignore:.*costs the step more than it saves")  # a cheap Metric, back to back
def test_updates_sent_in_one_message_run_one_by_one_each_with_its_callers_state(monkeypatch):
    counts = _updates_per_message(monkeypatch)
    offloaded, plain = _pair(SeesItsState)
    for i in range(200):
        x = torch.full((3,), float(i))
        for m in (offloaded, plain):
            if i % 3:
                m.update(x)
            else:
                with torch.no_grad():
                    m.update(x)
    assert_same_values(offloaded.compute(), plain.compute())
    assert sum(counts) == 200 and max(counts) > 1  # back to back, some went together


def test_an_update_that_raises_among_updates_sent_together_stops_the_ones_after_it(monkeypatch):
    counts = _updates_per_message(monkeypatch)
    offloaded, plain = _pair(Fails)
    values = [torch.ones(2)] * 30 + [-torch.ones(2)] + [torch.ones(2)] * 30
    for x in values[:30]:
        plain.update(x)
    with pytest.raises(ValueError, match="Expected non-negative values"):
        plain.update(values[30])
    with pytest.raises(ValueError, match=r"^Fails.update raised in lightning-store's offload worker, at update #31"):
        for x in values:
            offloaded.update(x)
        offloaded.compute()
    assert max(counts) > 1
    assert_same_values((offloaded.compute(), offloaded.update_count), (plain.compute(), plain.update_count))


class WarnsOnNaN(CatMetric):
    """Warns on a NaN, as `CatMetric(nan_strategy="warn")`; an update of a negative value keeps the worker busy."""

    def __init__(self):
        super().__init__(nan_strategy="warn")

    def update(self, value: Tensor) -> None:
        if (value < 0).any():
            time.sleep(0.5)  # the calls after it are held here, not sent yet
        super().update(value)


def test_an_update_held_here_warns_with_the_filters_at_its_call():
    offloaded = offload_to_cpu(WarnsOnNaN(), worker="process")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        offloaded.update(-torch.ones(1))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            offloaded.update(torch.tensor([float("nan")]))  # ignored here: ignored in the worker too
        assert len(_process_worker().outbox) == 1  # held, to go with the next ones
        offloaded.update(torch.tensor([float("nan"), 2.0]))
        offloaded.compute()
    assert [str(w.message).rsplit("(given by ", 1)[-1] for w in caught] == [
        "WarnsOnNaN.update #3, which ran in lightning-store's offload worker)"
    ]


def test_a_message_sent_after_updates_held_here_goes_after_them(monkeypatch):
    from lightning_store.metrics._offload.process import messages
    from lightning_store.metrics._offload.process.parent import _ProcessWorker

    kinds, send_bytes = [], _ProcessWorker.send_bytes

    def recorded(self, payload, start=False):
        kinds.append(type(messages._read(pickle.loads(payload))).__name__)
        send_bytes(self, payload, start)

    monkeypatch.setattr(_ProcessWorker, "send_bytes", recorded)
    offloaded, plain = _pair(WarnsOnNaN)
    values = (-torch.ones(1), torch.ones(1))
    for x in values:
        offloaded.update(x)
    assert len(_process_worker().outbox) == 1  # the second, held while the worker process runs the first
    _process_worker().send(messages._Resume(_queue_of(offloaded).id))
    assert kinds[-2:] == ["_Updates", "_Resume"] and not _process_worker().outbox
    for x in values:
        plain.update(x)
    assert_same_values(offloaded.compute(), plain.compute())


@pytest.mark.skipif("OMP_WAIT_POLICY" in os.environ, reason="OMP_WAIT_POLICY is set here: the worker process keeps it")
def test_the_worker_process_starts_with_openmp_threads_that_sleep_between_ops():
    metric = offload_to_cpu(SeesWaitPolicy(), worker="process")
    metric.update(torch.tensor(2.0))
    assert metric.compute() == 2.0  # PASSIVE there
    assert "OMP_WAIT_POLICY" not in os.environ  # and not here


def test_a_wait_policy_given_is_the_worker_processs(monkeypatch):
    from lightning_store.metrics._offload.process.parent import _passive_openmp

    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    with _passive_openmp():
        assert os.environ["OMP_WAIT_POLICY"] == "PASSIVE"
    assert "OMP_WAIT_POLICY" not in os.environ
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    with _passive_openmp():
        assert os.environ["OMP_WAIT_POLICY"] == "ACTIVE"
    assert os.environ["OMP_WAIT_POLICY"] == "ACTIVE"
