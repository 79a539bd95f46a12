"""How an update goes to the worker process and comes back: whole CPU tensors as plain values, answers by the run."""

import time

import pytest
import torch
from _metrics import SeesAll, SlowSum, assert_same_values, made_in_inference_mode
from torchmetrics import MeanMetric, SumMetric

from lightning_store import offload_to_cpu
from lightning_store.metrics._offload.process.inputs import _Whole
from lightning_store.metrics._offload.process.parent import _process_worker
from lightning_store.metrics._offload.queue import DEFAULT_MAX_PENDING, _answered_run
from lightning_store.metrics._reads import _queue_of

pytestmark = pytest.mark.no_lightning  # no Lightning here: not run again on each Lightning minor (.ci/run)


def _randn(*shape: int, seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _caught_up(timeout_s: float = 30.0) -> None:
    """Wait until the worker process has run every update sent to it (read in shared memory, with no message)."""
    worker = _process_worker()
    deadline = time.monotonic() + timeout_s
    while worker.busy():
        assert time.monotonic() < deadline, "the worker process did not run the updates sent to it"
        time.sleep(0.01)


@pytest.mark.parametrize(
    "make",
    [
        lambda: _randn(5),  # small: its bytes go with the message
        lambda: _randn(300, 7),  # large: through the arena
        lambda: _randn(300, 7, dtype=torch.float64),
        lambda: _randn(200, dtype=torch.bfloat16),
        lambda: torch.arange(-64, 64, dtype=torch.int8).reshape(8, 16),
        lambda: made_in_inference_mode(lambda: _randn(300, 7)),
        lambda: made_in_inference_mode(lambda: _randn(3)),
    ],
    ids=["small", "large", "float64", "bfloat16", "int8", "inference, large", "inference, small"],
)
def test_a_whole_cpu_tensor_reaches_the_update_as_the_plain_one(make):
    x = make()
    assert _Whole.of((x,), {}) is not None  # the plain-values path, not the general one
    plain, offloaded = SeesAll(), offload_to_cpu(SeesAll())
    for metric in (plain, offloaded):
        metric.update(x)
        metric.update(make())
    assert_same_values(offloaded.compute(), plain.compute())


def test_whole_tensors_passed_by_keyword_and_position_keep_their_names():
    values, weights = _randn(1000, seed=1), _randn(1000, seed=2).abs()
    plain, offloaded = MeanMetric(), offload_to_cpu(MeanMetric())
    for metric in (plain, offloaded):
        metric.update(values, weight=weights)
        metric.update(value=values[:3].clone(), weight=weights[:3].clone())
        metric.update(values.clone(), weights[:1000].clone())
    assert torch.equal(offloaded.compute(), plain.compute())


@pytest.mark.parametrize(
    "x",
    [_randn(40, 64)[:, ::2], _randn(0), _randn(10, 10).T, torch.tensor([1.0, 2.0]).to_sparse(), 3.5],
    ids=["a view", "empty", "transposed", "sparse", "a number"],
)
def test_inputs_that_are_not_whole_cpu_tensors_take_the_general_path(x):
    assert _Whole.of((x,), {}) is None


def test_an_update_goes_at_once_to_a_worker_process_that_has_caught_up_and_waits_while_it_is_busy():
    metric = offload_to_cpu(SlowSum(0.5))
    metric.update(torch.tensor(1.0))
    metric.compute()  # the worker process has run everything
    worker = _process_worker()
    assert not worker.busy()
    metric.update(torch.tensor(2.0))  # sent at once: nothing waits in this process
    assert not worker.outbox
    metric.update(torch.tensor(3.0))  # the worker process sleeps in the last one: held, to go with the next ones
    assert len(worker.outbox) == 1
    assert metric.compute().item() == 6.0


@pytest.mark.parametrize("max_pending", [None, 6, 16], ids=["default", "6", "16"])
def test_the_worker_process_answers_a_short_run_of_updates_only_when_asked(max_pending):
    kwargs = {} if max_pending is None else {"max_pending": max_pending}
    metric, plain = offload_to_cpu(SumMetric(), **kwargs), SumMetric()
    run = _answered_run(_queue_of(metric).max_pending)  # half the queue's room
    assert run == (max_pending or DEFAULT_MAX_PENDING["process"]) // 2
    metric.update(torch.tensor(0.0))
    metric.compute()
    worker = _process_worker()
    for value in range(1, run):  # fewer than a run that is answered unasked
        metric.update(torch.tensor(float(value)))
        plain.update(torch.tensor(float(value)))
        _caught_up()  # each sent at once, and run
        assert not worker.outbox
    worker.receive_ready()
    assert worker.running == run - 1  # run there, not answered: no answer to read at each call
    assert metric.compute().item() == plain.compute().item() == sum(range(run))
    assert worker.running == 0


@pytest.mark.filterwarnings("ignore:.*falls behind")  # back to back on purpose: the calls wait for the worker
@pytest.mark.parametrize("max_pending", [8, 16])
def test_back_to_back_updates_go_and_are_answered_by_half_the_queue(max_pending, monkeypatch):
    metric, plain = offload_to_cpu(SlowSum(0.002), max_pending=max_pending), SumMetric()
    metric.update(torch.tensor(0.0))
    metric.compute()
    worker = _process_worker()
    sent, answers = [], []
    send_updates, take = worker._send_updates, worker._take
    monkeypatch.setattr(worker, "_send_updates", lambda updates: sent.append(len(updates)) or send_updates(updates))
    monkeypatch.setattr(worker, "_take", lambda message: answers.append(message) or take(message))
    for value in range(1, 65):  # each call comes faster than the worker process runs one
        metric.update(torch.tensor(float(value)))
        plain.update(torch.tensor(float(value)))
    assert metric.compute().item() == plain.compute().item() == sum(range(65))
    run = max_pending // 2
    assert max(sent) == run and sum(sent) == 64
    assert sent.count(run) >= 64 // run - 2  # the first while the worker process was idle, the last at the read
    ran = [len(answer.done) for answer in answers if type(answer).__name__ == "_Ran"]
    assert max(ran) == run and len(ran) <= 64 // run + 2
