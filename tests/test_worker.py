"""The offload worker's life in a process: started lazily, one for all, safe across fork, gone promptly at exit."""

import subprocess
import sys
import textwrap
import time

import pytest
from _support import HANG_S

pytestmark = pytest.mark.no_lightning  # no Lightning here: not run again on each Lightning minor (.ci/run)

PRELUDE = """
import os, pickle, sys, threading, time
import torch
from torchmetrics import CatMetric, Metric, SumMetric
from lightning_store import offload_to_cpu
from lightning_store.metrics._offload.thread.worker import _THREAD, _thread_worker


class Slow(SumMetric):
    def update(self, value):
        time.sleep(float(os.environ.get("SLOW_S", "0.05")))
        super().update(value)
"""


def _run(body: str, **env: str) -> subprocess.CompletedProcess:
    script = PRELUDE + textwrap.dedent(body)
    return subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=HANG_S,
        env={**__import__("os").environ, **env},
    )


def _ok(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def test_the_worker_starts_at_the_first_update_only():
    out = _ok(
        _run("""
        metric = offload_to_cpu(CatMetric(), worker="thread")
        print(_thread_worker().thread is None, _THREAD.registered)
        metric.update(torch.tensor([1.0]))
        print(_thread_worker().thread.name, _THREAD.registered, metric.compute().sum().item())
        """)
    )
    assert out.split("\n")[:2] == ["True False", "lightning-store-offload True 1.0"]


def test_dataloader_workers_forked_with_updates_queued_do_not_deadlock():
    out = _ok(
        _run("""
        from torch.utils.data import DataLoader
        metric, plain = offload_to_cpu(Slow(), max_pending=64, worker="thread"), SumMetric()
        metric.update(torch.tensor(0.0))
        for value in range(1, 21):
            metric.update(torch.tensor(float(value)))
            plain.update(torch.tensor(float(value)))
        print("pending at the fork", metric._offload.pending > 0)
        loader = DataLoader(list(range(8)), batch_size=2, num_workers=2, multiprocessing_context="fork")
        for epoch in range(2):  # two forks
            seen = [int(x) for batch in loader for x in batch]
            metric.update(torch.tensor(float(epoch)))
            plain.update(torch.tensor(float(epoch)))
        print(seen == list(range(8)), bool(metric.compute() == plain.compute()))
        """)
    )
    assert out.split("\n")[:2] == ["pending at the fork True", "True True"]


def test_a_forked_child_has_a_worker_of_its_own():
    out = _ok(
        _run("""
        metric = offload_to_cpu(Slow(), max_pending=64, worker="thread")
        for value in range(10):
            metric.update(torch.tensor(float(value)))
        pid = os.fork()
        if pid == 0:  # the child: every update queued before the fork is in its state, and new ones run here
            metric.update(torch.tensor(100.0))
            os._exit(0 if float(metric.compute()) == 145.0 else 3)
        _, status = os.waitpid(pid, 0)
        print(os.waitstatus_to_exitcode(status), float(metric.compute()))
        """)
    )
    assert out.split("\n")[0] == "0 45.0"


def test_the_process_exits_promptly_with_updates_pending():
    started = time.perf_counter()
    result = _run(
        """
        metric = offload_to_cpu(Slow(), max_pending=1000, worker="thread")
        for value in range(200):  # 100 s of updates
            metric.update(torch.tensor(float(value)))
        print("queued", metric._offload.pending, flush=True)
        print("exit at", time.perf_counter(), flush=True)
        """,
        SLOW_S="0.5",
    )
    ended = time.perf_counter()
    out = _ok(result)
    assert out.startswith("queued ") and int(out.split()[1]) > 150
    assert "Traceback" not in result.stderr and "Exception" not in result.stderr, result.stderr  # warnings may be
    assert ended - started < 60  # not the 100 s the queue holds (the interpreter's start is most of it)


@pytest.mark.parametrize("queued", [True, False])
def test_an_offloaded_metric_unpickled_in_a_fresh_process_runs_there(tmp_path, queued):
    path = tmp_path / "metric.pkl"
    _ok(
        _run(f"""
        metric = offload_to_cpu(Slow(), worker="thread")
        for value in range(5):
            metric.update(torch.tensor(float(value)))
        if not {queued}:
            metric.compute()
        with open({str(path)!r}, "wb") as f:
            pickle.dump(metric, f)  # waits for the queued updates
        """)
    )
    out = _ok(
        _run(f"""
        with open({str(path)!r}, "rb") as f:
            metric = pickle.load(f)
        print(type(metric).__mro__[1].__name__, float(metric.compute()), _thread_worker().thread is None)
        metric.update(torch.tensor(10.0))
        print(float(metric.compute()), _thread_worker().thread is not None)
        """)
    )
    assert out.split("\n")[:2] == ["_OffloadedMetric 10.0 True", "20.0 True"]


def test_an_update_after_the_worker_stopped_at_exit_runs_in_the_caller():
    out = _ok(
        _run("""
        metric = offload_to_cpu(SumMetric(), worker="thread")
        metric.update(torch.tensor(1.0))
        metric.compute()
        _thread_worker().stop()  # as at exit, before another exit handler updates the Metric
        metric.update(torch.tensor(2.0))
        print("late", float(metric.compute()), flush=True)
        """)
    )
    assert out.split("\n")[0] == "late 3.0"


def test_a_read_after_exit_dropped_updates_says_so():
    out = _ok(
        _run("""
        metric = offload_to_cpu(Slow(), max_pending=64, worker="thread")
        for value in range(5):
            metric.update(torch.tensor(float(value)))
        _thread_worker().stop()  # as at exit: the updates not yet run are dropped
        try:
            metric.compute()
        except RuntimeError as error:
            print(error)
        """)
    )
    assert out.startswith("Slow: ") and "update(s) were still queued when the process began to exit" in out
    assert "HINT: read the Metric (`compute()`) before the process exits" in out


# with worker="process": the Metrics of these scripts are torchmetrics' own (a class of `python -c` cannot be
# imported by the worker process); the worker process's start, a second or more, keeps the first updates pending


def test_dataloader_workers_forked_beside_a_worker_process_leave_it_alone():
    out = _ok(
        _run("""
        from torch.utils.data import DataLoader
        metric, plain = offload_to_cpu(SumMetric(), worker="process"), SumMetric()
        for value in range(20):
            metric.update(torch.tensor(float(value)))
            plain.update(torch.tensor(float(value)))
        print("pending at the fork", metric._offload.ahead())
        loader = DataLoader(list(range(8)), batch_size=2, num_workers=2, multiprocessing_context="fork")
        for epoch in range(2):
            seen = [int(x) for batch in loader for x in batch]
            metric.update(torch.tensor(float(epoch)))
            plain.update(torch.tensor(float(epoch)))
        print(seen == list(range(8)), bool(metric.compute() == plain.compute()))
        """)
    )
    assert out.split("\n")[:2] == ["pending at the fork True", "True True"]


def test_a_forked_child_reads_a_metric_whose_worker_process_was_ahead_only_to_be_told():
    out = _ok(
        _run("""
        ahead = offload_to_cpu(SumMetric(), worker="process")
        settled = offload_to_cpu(SumMetric(), worker="process")
        for value in range(10):
            ahead.update(torch.tensor(float(value)))
            settled.update(torch.tensor(float(value)))
        settled.compute()
        pid = os.fork()
        if pid == 0:  # the child: a worker process of its own for `settled`; `ahead`'s updates are not here
            settled.update(torch.tensor(100.0))
            try:
                ahead.compute()
                os._exit(3)
            except RuntimeError as error:
                told = "It was copied into a forked process" in str(error)
            os._exit(0 if told and float(settled.compute()) == 145.0 else 4)
        _, status = os.waitpid(pid, 0)
        print(os.waitstatus_to_exitcode(status), float(ahead.compute()), float(settled.compute()))
        """)
    )
    assert out.split("\n")[0] == "0 45.0 45.0"


def test_the_process_exits_promptly_with_updates_pending_in_a_worker_process():
    result = _run("""
        metric = offload_to_cpu(SumMetric(), worker="process", max_pending=1000)
        for value in range(200):
            metric.update(torch.tensor(float(value)))
        print("queued", metric._offload.pending, flush=True)
        """)
    out = _ok(result)
    assert out.startswith("queued ") and int(out.split()[1]) > 0
    assert "Traceback" not in result.stderr and "Exception" not in result.stderr, result.stderr
