"""An offloaded Metric whose worker falls behind the calls says so, once, with the figures and what to do."""

import re
import time
import warnings

import pytest
import pytorch_lightning as pl
import torch
from torch import Tensor
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics import SumMetric

from lightning_store import StoreOnCPUWarning, offload_to_cpu, storage_report
from lightning_store.metrics._offload.process.parent import _process_worker
from lightning_store.metrics._offload.queue import WINDOW, _Lag
from lightning_store.metrics._reads import _queue_of

# the Metrics here sleep in `update`, which is no work moved off the step: the payoff's warning is not what these test
pytestmark = pytest.mark.filterwarnings("ignore:.*costs the step more than it saves")


class Slow(SumMetric):
    seconds = 0.002  # a step of the tests' loops takes less

    def update(self, value: Tensor) -> None:
        time.sleep(self.seconds)
        super().update(value)


class Slower(Slow):
    seconds = 0.02  # a step of a short Lightning fit takes less


def test_a_worker_that_falls_behind_is_said_once_at_the_callers_line():
    metric, plain = offload_to_cpu(Slow(), max_pending=2, worker="thread"), SumMetric()
    with pytest.warns(StoreOnCPUWarning, match=r"^Slow: its offload worker falls behind: `update` waited") as caught:
        for _ in range(3 * WINDOW):
            metric.update(torch.ones(1))  # each call comes faster than the worker runs one
            plain.update(torch.ones(1))
    behind = [w for w in caught if "falls behind" in str(w.message)]
    assert len(behind) == 1 and behind[0].filename == __file__
    message = str(behind[0].message)
    assert f" of the last {WINDOW} calls' " in message
    waited, window = (float(figure) for figure in re.findall(r"([0-9.]+) s\b", message)[:2])
    assert 0 < window / 2 <= waited <= window  # the calls waited for half the window's time or more
    assert message.endswith("if the calls come in bursts, a larger max_pending (now 2) absorbs them.")
    assert _queue_of(metric).lag.behind
    assert torch.equal(metric.compute(), plain.compute())


@pytest.mark.parametrize("worker", ["process", "thread"])
def test_a_worker_that_falls_behind_is_said_with_the_default_max_pending(worker):
    # a caller waiting for room is woken once half of max_pending has run: few calls wait, for long
    metric, plain = offload_to_cpu(Slow(), worker=worker), SumMetric()
    with pytest.warns(StoreOnCPUWarning, match=r"^Slow: its offload worker falls behind: `update` waited") as caught:
        for _ in range(3 * WINDOW):
            metric.update(torch.ones(1))
            plain.update(torch.ones(1))
    queue = _queue_of(metric)
    assert queue.lag.behind and 0 < queue.waits < WINDOW // 2
    assert sum("falls behind" in str(w.message) for w in caught) == 1
    assert torch.equal(metric.compute(), plain.compute())


def test_a_wait_for_the_shared_memory_of_the_inputs_is_a_wait_for_the_worker_process():
    # inputs of 1 MiB an update: the shared memory they go through (16 MiB) fills before max_pending (64) updates
    # wait, and a caller faster than the worker process waits there, not for room in the queue
    metric, plain = offload_to_cpu(Slower(), worker="process"), SumMetric()
    value = torch.ones(2**18)
    with pytest.warns(StoreOnCPUWarning, match=r"^Slower: its offload worker falls behind: `update` waited") as caught:
        for _ in range(2 * WINDOW):  # the first window ends at the worker process's start
            metric.update(value)
            plain.update(value)
    queue = _queue_of(metric)
    assert queue.lag.behind and queue.waits > 0 and queue.waited_s > 0
    messages = [str(w.message) for w in caught]
    behind = [message for message in messages if "falls behind" in message]
    assert len(behind) == 1
    assert "waited for room in the queue or in the shared memory its inputs go through for " in behind[0]
    assert behind[0].endswith("or time the step with the Metric kept as it is (not offloaded).")  # no max_pending
    assert not any("more than it saves" in message for message in messages)  # the waits are not the hand-off
    assert torch.equal(metric.compute(), plain.compute())


def test_a_worker_process_that_keeps_up_with_inputs_that_fill_its_shared_memory_says_nothing():
    # the shared memory of 1 MiB inputs fills before the worker process answers (it answers a run of updates at
    # once): the call then waits for an answer of updates run already, which is no wait for the worker's pace
    metric, plain = offload_to_cpu(SumMetric(), worker="process"), SumMetric()
    value = torch.ones(2**18)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*falls behind", category=StoreOnCPUWarning)  # the lag's
        for _ in range(3 * WINDOW):
            metric.update(value)
            plain.update(value)
            time.sleep(0.01)  # a step the worker process keeps up with
    queue = _queue_of(metric)
    assert queue.waits <= 3 and not queue.lag.behind  # its start is one; a loaded machine may delay it at one or two
    assert torch.equal(metric.compute(), plain.compute())


def test_a_worker_that_keeps_up_says_nothing():
    metric = offload_to_cpu(SumMetric(), max_pending=2, worker="thread")
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*falls behind", category=StoreOnCPUWarning)  # the lag's
        for _ in range(2 * WINDOW):
            metric.update(torch.ones(1))
            _queue_of(metric).settle()  # a step long enough for the worker
    assert not _queue_of(metric).lag.behind
    assert metric.compute() == 2 * WINDOW


@pytest.mark.parametrize("worker", ["thread", "process"])
def test_a_worker_that_keeps_up_beside_a_step_says_nothing(worker):
    metric = offload_to_cpu(SumMetric(), worker=worker, max_pending=2)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*falls behind", category=StoreOnCPUWarning)  # the lag's
        for _ in range(2 * WINDOW):
            metric.update(torch.ones(1))
            time.sleep(0.005)  # a step: the worker runs the update meanwhile (a worker process's answer waits unread)
    queue = _queue_of(metric)
    assert not queue.lag.behind and queue.waits < WINDOW // 2  # a hiccup of the machine may make a call wait
    assert metric.compute() == 2 * WINDOW


def test_a_worker_process_starting_is_not_said_to_fall_behind():
    # the calls that wait for a worker process to start (seconds) wait for no update: it keeps up once started
    worker = _process_worker()
    if worker.process is not None:  # one started before: the first update here starts a new one
        worker.process.kill()
        worker.process.join(10)
    metric = offload_to_cpu(SumMetric(), worker="process", max_pending=2)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*falls behind", category=StoreOnCPUWarning)  # the lag's
        for _ in range(2 * WINDOW):
            metric.update(torch.ones(1))
            time.sleep(0.005)  # a step: the worker runs the update meanwhile, once it has started
    queue = _queue_of(metric)
    assert queue.waits >= 1 and queue.waited_s > 0.1  # the third call waited for the start, in the first window
    assert not queue.lag.behind
    assert metric.compute() == 2 * WINDOW


def test_a_wait_for_the_start_is_counted_in_all_and_a_new_window_starts_after_it():
    lag = _Lag()
    now = time.perf_counter()
    for _ in range(WINDOW - 1):  # calls queued while the worker process starts, the last of which waits
        assert lag.count(now, None, "M", 2) is None
    assert lag.count(now, 10.0, "M", 2, starting=True) is None
    assert (lag.waits, lag.waited_s, lag.window_calls) == (1, 10.0, 0)
    for _ in range(WINDOW - 1):
        assert lag.count(time.perf_counter(), None, "M", 2) is None
    assert lag.count(time.perf_counter(), 0.5, "M", 2) is not None  # a wait of most of the window's time
    assert lag.behind and lag.waits == 2


class SlowMetricModel(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(2, 1)
        self.slow = offload_to_cpu(Slower(), max_pending=1, worker="thread")
        self.rows: list = []

    def training_step(self, batch, batch_idx):
        (x,) = batch
        self.slow.update(x.sum().detach())
        self.log("slow", self.slow, on_step=False, on_epoch=True)
        return self.layer(x).sum()

    def on_train_batch_end(self, outputs, batch, batch_idx):
        if batch_idx == 2 * WINDOW - 1:  # the report reads the states: taken every step, it would hold the worker
            self.rows = storage_report(self.trainer)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_the_storage_report_says_when_the_worker_falls_behind(quiet_trainer_kwargs):
    model = SlowMetricModel()
    trainer = pl.Trainer(**quiet_trainer_kwargs, max_epochs=1)
    with pytest.warns(StoreOnCPUWarning, match="Slower: its offload worker falls behind"):
        trainer.fit(model, DataLoader(TensorDataset(torch.ones(2 * WINDOW, 2)), batch_size=1))
    (row,) = model.rows
    assert row.name == "slow" and row.offloaded and row.worker_behind and row.waited_s > 0


def test_a_caller_waiting_for_the_worker_thread_is_woken_once_a_run_of_updates_has_run(monkeypatch):
    from lightning_store.metrics._offload.thread.worker import _thread_worker

    metric, plain = offload_to_cpu(Slow(), max_pending=8, worker="thread"), SumMetric()
    metric.update(torch.ones(1))
    metric.compute()  # the worker thread started, and idle
    worker = _thread_worker()
    woken = []
    notify_all = worker.changed.notify_all

    def counted() -> None:
        woken.append(worker.is_worker_thread())
        notify_all()

    monkeypatch.setattr(worker.changed, "notify_all", counted)
    for value in range(1, 33):  # each call comes faster than the worker runs one: the callers wait for room
        metric.update(torch.tensor(float(value)))
        plain.update(torch.tensor(float(value)))
    plain.update(torch.ones(1))
    assert torch.equal(metric.compute(), plain.compute())  # waited for the last update: woken when none is left
    by_worker = woken.count(True)
    # once every 4 updates (half of max_pending), and when the queue ran dry; woken after each update: 32 times
    assert 32 // 4 <= by_worker <= 32 // 2
