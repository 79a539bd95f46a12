"""Faults a long training job meets, with either worker: no hang, no crash, and errors that name the real cause."""

import os
import subprocess
import sys
import textwrap

import pytest

HANG_BOUND_S = 120.0  # a run that hangs fails the test after this, rather than hanging the suite

PRELUDE = """
import gc, os, pickle, signal, sys, threading, time
import torch
from torchmetrics import CatMetric, SumMetric
from lightning_store import offload_to_cpu
from lightning_store.metrics import _process_worker
"""


FAULTY = """
import torch
from torchmetrics import SumMetric


class RaisesOnNegative(SumMetric):
    def __init__(self, exception="ValueError('negative')"):
        super().__init__()
        self.exception = exception

    def update(self, value):
        if value.sum() < 0:
            raise eval(self.exception)
        super().update(value)
"""


@pytest.fixture
def run(tmp_path):
    """Run a script by a Python of its own, beside a module ``faulty`` of Metrics a worker process can import."""
    (tmp_path / "faulty.py").write_text(FAULTY)

    def run(body: str, **env: str) -> subprocess.CompletedProcess:
        script = tmp_path / "script.py"
        script.write_text(PRELUDE + "\nif __name__ == '__main__':\n" + textwrap.indent(textwrap.dedent(body), "    "))
        path = os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])
        return _bounded([sys.executable, str(script)], env={**os.environ, "PYTHONPATH": path, **env}, cwd=tmp_path)

    return run


def _bounded(command: list[str], **kwargs) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(command, capture_output=True, text=True, timeout=HANG_BOUND_S, **kwargs)
    except subprocess.TimeoutExpired as expired:
        pytest.fail(f"hung: no end within {HANG_BOUND_S:.0f} s; its output: {expired.stdout!r} {expired.stderr!r}")


def _out(result: subprocess.CompletedProcess) -> list[str]:
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout.splitlines()


@pytest.mark.parametrize("exception", ["SystemExit(3)", "KeyboardInterrupt()", "GeneratorExit()"])
@pytest.mark.parametrize("worker", ["thread", "process"])
def test_a_base_exception_in_update_is_raised_at_the_next_call_and_the_worker_goes_on(run, worker, exception):
    out = _out(
        run(f"""
        from faulty import RaisesOnNegative
        metric = offload_to_cpu(RaisesOnNegative({exception!r}), worker={worker!r})
        metric.update(torch.ones(2))
        metric.update(-torch.ones(2))
        try:
            metric.compute()
        except BaseException as error:
            print(type(error).__name__, "|", error)
        metric.update(torch.ones(3))
        print(metric.compute().item())
        """)
    )
    name = exception.split("(")[0]
    assert out[0].startswith(
        f"{name} | RaisesOnNegative.update raised in lightning-store's offload worker, at update #2"
    )
    assert out[1] == "5.0"
