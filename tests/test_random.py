"""Python's and NumPy's global generators: an update that draws from them is found at any update, and said so."""

import random
import threading

import numpy as np
import pytest
import torch
from _metrics import DRAWS, DrawsOnLargeBatches
from torch import Tensor
from torchmetrics import SumMetric

from lightning_store import StoreOnCPUWarning, offload_to_cpu
from lightning_store.metrics._offload.thread.worker import _thread_worker
from lightning_store.metrics._reads import _queue_of

pytestmark = pytest.mark.no_lightning  # no Lightning here: not run again on each Lightning minor (.ci/run)

HOST_DRAWS = {name: draw for name, draw in DRAWS.items() if name != "torch's CPU"}  # torch's: `test_guard.py`


@pytest.mark.parametrize("generator", HOST_DRAWS)
def test_a_draw_at_a_later_update_raises_at_the_next_call(generator):
    metric = offload_to_cpu(DrawsOnLargeBatches(generator), worker="thread")
    metric.update(torch.ones(2))
    metric.update(torch.ones(8))
    _thread_worker().quiesce()
    states = (random.getstate(), np.random.get_state()[1].copy())
    with pytest.raises(RuntimeError) as err:
        metric.compute()
    assert str(err.value).startswith(
        f"DrawsOnLargeBatches.update drew random numbers from {generator} global generator, at update #2 since"
        " offload_to_cpu, in lightning-store's offload worker."
    )
    assert str(err.value).endswith(
        "HINT: keep this Metric as it is (not offloaded), or give its update a generator of its own"
        " (`random.Random(seed)`, `np.random.default_rng(seed)`)."
    )
    assert random.getstate() == states[0] and np.array_equal(np.random.get_state()[1], states[1])  # the trial's


GATE = threading.Event()  # held by `WaitsForGate.update` (a Metric cannot deep-copy an event of its own)
ENTERED = threading.Event()  # set once the update runs in the worker


class WaitsForGate(SumMetric):
    def update(self, value: Tensor) -> None:
        ENTERED.set()
        GATE.wait()
        super().update(value)


@pytest.mark.parametrize("generator", HOST_DRAWS)
def test_a_draw_of_the_training_thread_while_an_update_runs_is_not_taken_for_the_updates(generator):
    GATE.clear()
    ENTERED.clear()
    metric, plain = offload_to_cpu(WaitsForGate(), worker="thread"), SumMetric()
    metric.update(torch.ones(3))
    plain.update(torch.ones(3))
    assert ENTERED.wait(10)
    drawn = [HOST_DRAWS[generator]() for _ in range(3)]  # while the update waits in the worker
    GATE.set()
    _thread_worker().quiesce()
    assert _queue_of(metric).suspect is not None  # the generator changed while the update ran
    assert torch.equal(metric.compute(), plain.compute())  # tried on a copy, which drew nothing: no error
    assert _queue_of(metric).suspect is None
    assert len(set(drawn)) == 3


class Uncopyable(DrawsOnLargeBatches):
    def __deepcopy__(self, memo):
        raise TypeError("cannot copy this")


def test_a_metric_that_cannot_be_copied_warns_that_it_could_not_be_tried():
    metric = offload_to_cpu(Uncopyable("Python's `random`"), worker="thread")
    metric.update(torch.ones(8))
    _thread_worker().quiesce()
    with pytest.warns(StoreOnCPUWarning, match=r"^Uncopyable: Python's or NumPy's global generator was drawn") as rec:
        metric.compute()
    assert rec[0].filename == __file__


def _full_states() -> tuple:
    """Python's and NumPy's generators' states as they give them: the oracle for the states as compared."""
    numpy = np.random.get_state(legacy=False)
    return random.getstate(), numpy["state"]["pos"], numpy["state"]["key"].tolist(), numpy["has_gauss"], numpy["gauss"]


PYTHONS, NUMPYS = "Python's `random`", "NumPy's `np.random`"
CHANGES = {  # what changes a generator's state, and whose
    "nothing": ([], lambda: None),
    "a uniform draw from Python's": ([PYTHONS], random.random),
    "a normal deviate from Python's": ([PYTHONS], lambda: random.gauss(0, 1)),
    "a seed of Python's": ([PYTHONS], lambda: random.seed(1)),
    "a uniform draw from NumPy's": ([NUMPYS], np.random.rand),
    "a normal deviate from NumPy's": ([NUMPYS], np.random.normal),
    "a seed of NumPy's": ([NUMPYS], lambda: np.random.seed(1)),
    "a state set in NumPy's": ([NUMPYS], lambda: np.random.set_state(np.random.RandomState(5).get_state())),
}


@pytest.mark.parametrize("spare", [False, True], ids=["no spare deviate", "a spare deviate kept"])
@pytest.mark.parametrize("change", CHANGES)
def test_the_host_generators_as_compared_tell_every_change_their_full_states_tell(change, spare):
    from lightning_store.metrics._offload.draws import _drawn, _host_states

    random.seed(0)
    np.random.seed(0)
    if spare:  # each keeps the second deviate of a pair: the next normal deviate moves no word of its state
        random.gauss(0, 1)
        np.random.normal()
    _host_states()
    before, full_before = _host_states(), _full_states()  # the second read from memory
    changed, make_change = CHANGES[change]
    make_change()
    after, full_after = _host_states(), _full_states()
    oracle = [PYTHONS] * (full_before[0] != full_after[0]) + [NUMPYS] * (full_before[1:] != full_after[1:])
    assert _drawn(before, after) == oracle == changed


def test_numpys_state_is_read_in_full_only_when_it_may_have_changed(monkeypatch):
    from lightning_store.metrics._offload import draws

    np.random.seed(0)
    draws._host_states()
    reads = []
    full = draws._numpy_state.full
    monkeypatch.setattr(draws._numpy_state, "full", lambda generator: reads.append(1) or full(generator))
    for _ in range(5):
        draws._host_states()
    assert reads == []  # unchanged, no spare deviate: known from its words in memory
    assert draws._python_state.checked and draws._numpy_state.checked  # both read from memory here (CPython)
    np.random.rand()
    draws._host_states()
    draws._host_states()
    assert reads == [1]


class DrawsTheSpareDeviate(SumMetric):
    def update(self, value: Tensor) -> None:
        super().update(value + np.random.normal() if value.numel() > 4 else value)


def test_an_update_that_takes_numpys_spare_normal_deviate_raises():
    metric = offload_to_cpu(DrawsTheSpareDeviate(), worker="thread")
    metric.update(torch.ones(2))
    _thread_worker().quiesce()
    np.random.seed(0)
    np.random.normal()  # a spare deviate kept: the update's draw moves no word of the Twister
    metric.update(torch.ones(8))
    drawn = r"drew random numbers from NumPy's `np.random` global generator, at update #2"
    with pytest.raises(RuntimeError, match=drawn):
        metric.compute()
