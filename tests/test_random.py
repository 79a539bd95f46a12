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

HOST_DRAWS = {name: draw for name, draw in DRAWS.items() if name != "torch's CPU"}  # torch's: `test_guard.py`


@pytest.mark.parametrize("generator", HOST_DRAWS)
def test_a_draw_at_a_later_update_raises_at_the_next_call(generator):
    metric = offload_to_cpu(DrawsOnLargeBatches(generator))
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
    metric, plain = offload_to_cpu(WaitsForGate()), SumMetric()
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
    metric = offload_to_cpu(Uncopyable("Python's `random`"))
    metric.update(torch.ones(8))
    _thread_worker().quiesce()
    with pytest.warns(StoreOnCPUWarning, match=r"^Uncopyable: Python's or NumPy's global generator was drawn") as rec:
        metric.compute()
    assert rec[0].filename == __file__
