"""An offloaded Metric whose worker falls behind the calls says so, once, with the figures and what to do."""

import time
import warnings

import pytest
import torch
from torch import Tensor
from torchmetrics import SumMetric

from lightning_store import StoreOnCPUWarning, offload_to_cpu
from lightning_store.metrics._lag import WINDOW
from lightning_store.metrics._offloaded import _queue_of


class Slow(SumMetric):
    def update(self, value: Tensor) -> None:
        time.sleep(0.002)
        super().update(value)


def test_a_worker_that_falls_behind_is_said_once_at_the_callers_line():
    metric, plain = offload_to_cpu(Slow(), max_pending=2), SumMetric()
    with pytest.warns(StoreOnCPUWarning, match=r"^Slow: its offload worker falls behind: `update` waited") as caught:
        for _ in range(3 * WINDOW):
            metric.update(torch.ones(1))  # each call comes faster than the worker runs one
            plain.update(torch.ones(1))
    behind = [w for w in caught if "falls behind" in str(w.message)]
    assert len(behind) == 1 and behind[0].filename == __file__
    message = str(behind[0].message)
    assert f" of the last {WINDOW} calls (" in message
    assert message.endswith("if the calls come in bursts, a larger max_pending (now 2) absorbs them.")
    assert _queue_of(metric).lag.behind
    assert torch.equal(metric.compute(), plain.compute())


def test_a_worker_that_keeps_up_says_nothing():
    metric = offload_to_cpu(SumMetric(), max_pending=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error", StoreOnCPUWarning)
        for _ in range(2 * WINDOW):
            metric.update(torch.ones(1))
            _queue_of(metric).settle()  # a step long enough for the worker
    assert not _queue_of(metric).lag.behind
    assert metric.compute() == 2 * WINDOW
