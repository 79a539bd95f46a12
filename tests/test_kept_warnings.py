"""A warning an offloaded update gives in the worker is given once, in the caller's thread, at its next call."""

import threading
import warnings

import pytest
import torch
from torchmetrics import CatMetric, MeanMetric

from lightning_store import offload_to_cpu
from lightning_store.metrics._offload.thread.worker import _thread_worker

NAN = torch.tensor([1.0, float("nan")])


def _warnings_of(call) -> list[warnings.WarningMessage]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        call()
    return caught


@pytest.mark.parametrize("make", [lambda: CatMetric(nan_strategy="warn"), lambda: MeanMetric(nan_strategy="warn")])
def test_a_warning_of_an_update_is_given_once_at_the_next_call_with_its_category_and_message(make):
    plain = _warnings_of(lambda: make().update(NAN))
    metric = offload_to_cpu(make(), worker="thread")
    assert _warnings_of(lambda: metric.update(NAN)) == []  # not given in the worker...
    _thread_worker().quiesce()
    given = _warnings_of(lambda: metric.compute())  # ...but at the next call, once
    assert [w.category for w in given] == [w.category for w in plain] == [UserWarning]
    name = type(metric).__name__
    assert str(given[0].message) == (
        f"{plain[0].message} (given by {name}.update #1, which ran in lightning-store's offload worker)"
    )
    with open(__file__) as source:
        line = source.read().splitlines()[given[0].lineno - 1]
    assert given[0].filename == __file__ and "given = _warnings_of(lambda: metric.compute())" in line
    assert _warnings_of(lambda: metric.compute()) == []


def test_pytest_warns_sees_it_around_the_update_and_a_read():
    metric = offload_to_cpu(CatMetric(nan_strategy="warn"), worker="thread")
    with pytest.warns(UserWarning, match=r"`nan` values in tensor.*given by CatMetric.update #1"):
        metric.update(NAN)
        metric.compute()


def test_a_warning_turned_into_an_error_fails_the_update_as_the_plain_one():
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        with pytest.raises(UserWarning, match="`nan` values in tensor") as plain_error:
            CatMetric(nan_strategy="warn").update(NAN)
        metric = offload_to_cpu(CatMetric(nan_strategy="warn"), worker="thread")
        metric.update(NAN)
        _thread_worker().quiesce()
    with pytest.raises(UserWarning, match=r"^CatMetric.update raised in lightning-store's offload worker") as err:
        metric.compute()
    assert f"at update #1 since offload_to_cpu: {plain_error.value}" in str(err.value)


def test_a_warning_of_another_thread_is_shown_as_it_would_be():
    metric = offload_to_cpu(MeanMetric(), worker="thread")
    metric.update(torch.ones(1))
    metric.compute()  # the worker runs: warnings go through lightning-store's route
    caught = _warnings_of(lambda: _in_thread(lambda: warnings.warn("from another thread", UserWarning, stacklevel=1)))
    assert [str(w.message) for w in caught] == ["from another thread"]


def _in_thread(call) -> None:
    thread = threading.Thread(target=call)
    thread.start()
    thread.join()


def _shown(metric, updates: int, action: str) -> int:
    """How many of ``metric``'s warnings are shown for ``updates`` updates of a NaN under the filter ``action``."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter(action)
        for _ in range(updates):
            metric.update(NAN)
        metric.compute()
    return sum("`nan` values in tensor" in str(w.message) for w in caught)


@pytest.mark.parametrize("worker", ["thread", "process"])
def test_a_warning_given_at_every_update_is_shown_as_often_as_the_plain_ones(worker):
    plain = CatMetric(nan_strategy="warn")
    metric = offload_to_cpu(CatMetric(nan_strategy="warn"), worker=worker)
    for action, times in (("default", 1), ("default", 1), ("always", 5), ("once", 1)):  # a new context each time
        assert _shown(metric, 5, action) == _shown(plain, 5, action) == times, action
