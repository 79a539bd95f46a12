"""An offloaded Metric that costs the step more than it saves says so, once, with the figures, logged or not."""

import warnings

import pytest
import torch
from torch import Tensor
from torchmetrics import MeanMetric, SumMetric

from lightning_store import StoreOnCPUWarning, offload_to_cpu
from lightning_store.metrics._offload.payoff import WARM_UP, WINDOW, _Payoff
from lightning_store.metrics._reads import _queue_of

pytestmark = pytest.mark.no_lightning  # no Lightning here: not run again on each Lightning minor (.ci/run)


def _fed(payoff: _Payoff, handoff_s: float, saved_s: float, held_s: float, worker: str = "thread") -> list[str]:
    """Feed ``payoff`` the same figures for the first updates and a window; the messages it returned."""
    messages = []
    for _ in range(WARM_UP + WINDOW):
        payoff.ran(saved_s, held_s)
        message = payoff.called(handoff_s, "Cheap", worker)
        if message is not None:
            messages.append(message)
    return messages


def test_a_handoff_and_held_time_over_the_work_moved_is_said_once_with_the_figures():
    payoff = _Payoff()
    messages = _fed(payoff, handoff_s=0.0002, saved_s=0.0003, held_s=0.0004)
    assert messages == [
        f"Cheap: offloading it costs the step more than it saves. Over the last {WINDOW} updates (medians), handing"
        " one to the thread worker took 0.200 ms of the step, and the worker thread held Python's interpreter up to"
        " 0.400 ms around it (time a step that runs Python, as one launching GPU kernels does, waits for), against"
        " 0.300 ms of the update's own work moved off the step. HINT: keep this Metric as it is (not offloaded):"
        " offloading pays for a Metric whose update takes well over the hand-off, which `python -m lightning_store`"
        " measures on this machine."
    ]
    assert _fed(payoff, handoff_s=0.0002, saved_s=0.0003, held_s=0.0004) == []  # once


def test_a_worker_process_counts_the_handoff_against_the_whole_update():
    messages = _fed(_Payoff(), handoff_s=0.0005, saved_s=0.0004, held_s=0.0, worker="process")
    assert len(messages) == 1
    assert "to the process worker took 0.500 ms of the step, against 0.400 ms of the update's own" in messages[0]
    assert "interpreter" not in messages[0]


def test_work_moved_over_the_handoff_says_nothing_and_the_first_updates_are_not_counted():
    payoff = _Payoff()
    for _ in range(WARM_UP):  # a worker starting: its first updates cost the step seconds
        payoff.ran(0.0001, 0.0)
        assert payoff.called(5.0, "Starting", "process") is None
    assert _fed(payoff, handoff_s=0.0002, saved_s=0.002, held_s=0.0003) == []
    assert not payoff.told


@pytest.mark.parametrize("worker", ["thread", "process"])
def test_a_cheap_metric_offloaded_warns_at_the_callers_line_though_never_logged(worker):
    metric, plain = offload_to_cpu(MeanMetric(), worker=worker), MeanMetric()
    # several windows: on a busy machine one window's medians may come out even (the worker's update descheduled)
    values = torch.rand(8 * WINDOW, generator=torch.Generator().manual_seed(0))
    said_first = r"^MeanMetric: offloading it costs the step more than it saves"
    with pytest.warns(StoreOnCPUWarning, match=said_first) as caught:
        for value in values:
            metric.update(value)  # a scalar: the copy and the hand-over cost more than the update's few ops
            plain.update(value)
    said = [w for w in caught if "offloading it costs the step" in str(w.message)]
    assert len(said) == 1 and said[0].filename == __file__
    assert _queue_of(metric).payoff.told
    assert torch.equal(metric.compute(), plain.compute())


class Costly(SumMetric):
    def update(self, value: Tensor) -> None:  # milliseconds of a few torch ops, from an input of a few hundred floats
        matrix = torch.outer(value, value)
        for _ in range(6):
            matrix = matrix @ matrix / matrix.shape[0]
        super().update(matrix.sum())


@pytest.mark.parametrize("worker", ["thread", "process"])
def test_a_metric_whose_update_takes_longer_than_its_handoff_says_nothing(worker):
    metric, plain = offload_to_cpu(Costly(), worker=worker), Costly()
    values = torch.rand(WARM_UP + 2 * WINDOW, 400, generator=torch.Generator().manual_seed(0))
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*offloading it costs the step", category=StoreOnCPUWarning)
        for value in values:
            metric.update(value)
            plain.update(value)
        assert torch.equal(metric.compute(), plain.compute())
    assert not _queue_of(metric).payoff.told
