"""Modules, data, a recording logger and a manual transfer, shared by the tests and the DDP worker scripts; and the
one runner of multi-process tests, :func:`run_workers`."""

import contextlib
import importlib.util
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import pytorch_lightning.cli
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_store import StoreOnCPUMixin
from lightning_store._selfcheck._fits import MemoryLogger

# what `LightningCLI` needs, as Lightning checks it (`jsonargparse[signatures]` of some version)
CLI_AVAILABLE = bool(
    getattr(pytorch_lightning.cli, "_JSONARGPARSE_SIGNATURES_AVAILABLE", importlib.util.find_spec("jsonargparse"))
)
CLI_REASON = "LightningCLI needs jsonargparse[signatures], which is not installed here"

REDUCTIONS = ("mean", "sum", "max", "min")
LEVELS = ((True, False), (False, True), (True, True))  # (on_step, on_epoch)

# The bound after which a multi-process run is failed as a hang. It guards against a hang, it is not a speed test:
# a run that takes 20 to 60 s on a quiet 2-core machine must still meet it on that machine three times oversubscribed.
HANG_S = 600.0
PORT_ATTEMPTS = 3  # a rendezvous port taken between `free_port()` and the workers' bind: run again on a fresh one
_PORT_TAKEN = re.compile(r"EADDRINUSE|address already in use", re.IGNORECASE)
_GRACE_S = 10.0  # once a worker failed, how long the others get to end before they are killed
_TAIL = 3000  # characters of each worker's output shown when a run fails


@dataclass(frozen=True)
class WorkerRun:
    """How long a :func:`run_workers` call took, and in how many attempts (``tests/conftest.py`` prints them)."""

    worker: str
    world_size: int
    seconds: float
    attempts: int


RUNS: list[WorkerRun] = []  # every run of this session, for the summary at its end


def free_port() -> int:
    """A TCP port on the loopback that nothing listens on now, for a process group's rendezvous."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def run_workers(
    worker: Path, out: Path, *, world_size: int = 2, one_process_launches_all: bool = False, **env: str
) -> list[dict[str, Any]]:
    """Run ``worker`` as a ``world_size``-process group on the loopback; return what each rank wrote.

    Each process runs ``python WORKER OUT`` in a process group of its own, with this checkout on ``PYTHONPATH``,
    ``MASTER_ADDR``/``MASTER_PORT`` set to a free loopback port and no rank variables but those given here. Its
    output goes to ``OUT/worker{i}.log``. A run that fails because its port was taken after it was probed
    ("address already in use") is run again on a fresh port, up to ``PORT_ATTEMPTS`` times in all. A run is failed
    (``pytest.fail``, with the time it took and the tail of every worker's output) when a worker exits non-zero or
    when the whole run has not ended within ``HANG_S``; every process group is killed when it ends, whatever happens.

    Args:
        worker: a script beside this file, run as ``python WORKER OUT``.
        out: the directory the ranks write ``rank{r}.json`` into (and the logs).
        world_size: the number of ranks.
        one_process_launches_all: start one process, which starts the other ranks itself (Lightning's DDP
            strategy); otherwise start one process per rank, with ``RANK``, ``LOCAL_RANK`` and ``WORLD_SIZE`` set.
        **env: more environment variables for every process.

    Returns:
        ``json.loads`` of ``OUT/rank{r}.json`` for each rank ``r``, in rank order.
    """
    started = time.monotonic()
    for attempt in range(1, PORT_ATTEMPTS + 1):
        for stale in out.glob("rank*.json"):
            stale.unlink()
        launches = [{}] if one_process_launches_all else [_rank_env(rank, world_size) for rank in range(world_size)]
        port = str(free_port())
        logs = [out / f"worker{index}.log" for index in range(len(launches))]
        processes = [
            _start(worker, out, log, {**env, **extra, "MASTER_PORT": port})
            for log, extra in zip(logs, launches, strict=True)
        ]
        try:
            codes = _wait(processes, deadline=started + HANG_S)
        finally:
            for process in processes:
                _kill(process)  # a rank left behind must not outlive the run
        outputs = [log.read_text(errors="replace") for log in logs]
        what = f"the {world_size}-process run of {worker.name} (attempt {attempt} of {PORT_ATTEMPTS}, port {port})"
        if None in codes and all(code in (None, 0) for code in codes):  # nothing failed: it hangs
            pytest.fail(f"{what} did not end within the hang bound of {HANG_S:.0f} s{_tails(codes, outputs, started)}")
        if all(code == 0 for code in codes):
            break
        if attempt == PORT_ATTEMPTS or not any(_PORT_TAKEN.search(output) for output in outputs):
            pytest.fail(f"{what} failed{_tails(codes, outputs, started)}")
    RUNS.append(WorkerRun(worker.name, world_size, round(time.monotonic() - started, 1), attempt))
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(world_size)]


def finish_rank(out: Path, rank: int, world_size: int, record: dict[str, Any]) -> None:
    """End a rank started by :func:`run_workers`: write ``OUT/rank{rank}.json``, wait for every rank's, and exit 0.

    A rank writes its record after its last collective, so once every record is there no collective is in flight,
    and the process exits at once, without tearing its process group down: on torch 2.3 freeing a gloo group can
    deadlock (its worker threads wait for the interpreter lock that the freeing thread holds), and a rank that
    leaves while another still receives the last collective's data fails that rank.
    """
    path = out / f"rank{rank}.json"
    path.with_suffix(".part").write_text(json.dumps(record))
    path.with_suffix(".part").replace(path)  # whole, or not there
    deadline = time.monotonic() + HANG_S
    while not all((out / f"rank{other}.json").exists() for other in range(world_size)):
        if time.monotonic() > deadline:
            os._exit(3)
        time.sleep(0.05)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _rank_env(rank: int, world_size: int) -> dict[str, str]:
    return {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size)}


def _start(worker: Path, out: Path, log: Path, env: dict[str, str]) -> subprocess.Popen:
    full = {**os.environ, "MASTER_ADDR": "127.0.0.1", "PYTHONUNBUFFERED": "1"}
    for name in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK"):
        full.pop(name, None)
    full["PYTHONPATH"] = os.pathsep.join(filter(None, [str(worker.parent.parent), full.get("PYTHONPATH")]))
    with log.open("w") as sink:  # the child keeps its own handle: no pipe to fill up and block it
        return subprocess.Popen(
            [sys.executable, str(worker), str(out)],
            env={**full, **env},
            cwd=worker.parent,
            start_new_session=True,
            stdin=subprocess.DEVNULL,
            stdout=sink,
            stderr=subprocess.STDOUT,
        )


def _wait(processes: list[subprocess.Popen], deadline: float) -> list[int | None]:
    """Exit codes once every process ended; ``None`` for one still running at the deadline.

    Once one has failed, the others (which may wait for it in a collective) get ``_GRACE_S`` to end.
    """
    while True:
        codes = [process.poll() for process in processes]
        if None not in codes:
            return codes
        if any(code not in (None, 0) for code in codes):
            deadline = min(deadline, time.monotonic() + _GRACE_S)
        if time.monotonic() > deadline:
            return codes
        time.sleep(0.1)


def _kill(process: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()


def _tails(codes: list[int | None], outputs: list[str], started: float) -> str:
    text = f" after {time.monotonic() - started:.1f} s (hang bound {HANG_S:.0f} s)."
    for index, (code, output) in enumerate(zip(codes, outputs, strict=True)):
        state = "still running, killed" if code is None else f"exit code {code}"
        text += f"\n--- worker {index} ({state}), the last {_TAIL} characters of its output:\n{output[-_TAIL:]}"
    return text


def loader(n: int = 10, batch_size: int = 4, seed: int = 0) -> DataLoader:
    """Batches of 4, 4 and 2 rows, so a mean weighted by batch size differs from a plain mean."""
    generator = torch.Generator().manual_seed(seed)
    return DataLoader(TensorDataset(torch.randn(n, 3, generator=generator)), batch_size=batch_size)


class PlainLoggingModel(pl.LightningModule):
    """Logs every reduction at every level in training, validation and test, from tensors and from numbers.

    A plain LightningModule, as a Lightning 1.x project has them; :class:`LoggingModel` is the same with the mixin.

    Args:
        store_on_cpu: passed to every ``self.log`` call (``None``: not passed).
        explicit_batch_size: pass ``batch_size`` to ``self.log`` instead of letting Lightning infer it.
        check_storage: after each call, assert that every tensor kept for a key stored on the CPU is on the CPU
            (with ``store_on_cpu=True``, or under ``Trainer(move_metrics_to_cpu=True)``).
    """

    def __init__(
        self, store_on_cpu: bool | None = None, explicit_batch_size: bool = False, check_storage: bool = True
    ) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(3, 1)
        self.store = store_on_cpu
        self.explicit_batch_size = explicit_batch_size
        self.check_storage = check_storage
        self.checked_keys: set[str] = set()
        self.model_devices: set[str] = set()
        self.callback_devices: set[str] = set()  # of `trainer.callback_metrics` values, seen during training

    def _log_everything(self, stage: str, batch: Any, batch_idx: int) -> torch.Tensor:
        (x,) = batch
        out = self.layer(x)
        loss = out.pow(2).mean()
        kwargs = {} if self.store is None else {"store_on_cpu": self.store}
        if self.explicit_batch_size:
            kwargs["batch_size"] = len(x)
        for reduce_fx in REDUCTIONS:
            for on_step, on_epoch in LEVELS:
                suffix = f"{reduce_fx}_{int(on_step)}{int(on_epoch)}"
                self.log(
                    f"{stage}_{suffix}",
                    x[:, 0].mean() + batch_idx,
                    reduce_fx=reduce_fx,
                    on_step=on_step,
                    on_epoch=on_epoch,
                    prog_bar=reduce_fx == "mean",
                    **kwargs,
                )
                self.log(
                    f"{stage}_num_{suffix}",
                    float(batch_idx) * 0.5 - 1,
                    reduce_fx=reduce_fx,
                    on_step=on_step,
                    on_epoch=on_epoch,
                    **kwargs,
                )
        self.log(f"{stage}_loss", loss, **kwargs)
        self._check_storage()
        self.model_devices.add(self.device.type)
        return loss

    def _check_storage(self) -> None:
        expected = self.store  # as the policy resolves: the argument, the module's default, the Trainer's flag
        if expected is None:
            expected = getattr(self, "store_on_cpu_default", None)
        if expected is None:
            expected = getattr(self.trainer, "move_metrics_to_cpu", False)
        if not self.check_storage or not expected:
            return
        from lightning_store._logged.result import _StoredOnCPU

        for key, result in self.trainer._results.items():
            if not result.is_tensor:
                continue
            assert isinstance(result, _StoredOnCPU), key
            for tensor in stored_tensors(result):
                assert tensor.device.type == "cpu", (key, tensor.device)
            self.checked_keys.add(key)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self._log_everything("train", batch, batch_idx)

    def validation_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        self._log_everything("val", batch, batch_idx)

    def test_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        self._log_everything("test", batch, batch_idx)

    def on_train_epoch_end(self) -> None:
        self.callback_devices.update(value.device.type for value in self.trainer.callback_metrics.values())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class LoggingModel(StoreOnCPUMixin, PlainLoggingModel):
    """:class:`PlainLoggingModel` with the mixin; ``store_on_cpu`` is passed to every call (``None``: not passed)."""

    def __init__(self, store_on_cpu: bool | None = True, **kwargs: Any) -> None:
        super().__init__(store_on_cpu, **kwargs)


class LoggingCallback(pl.Callback):
    """Logs from callback hooks, with ``pl_module.log``, in training and in every evaluation loop."""

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        pl_module.log("cb_train_batch", batch[0].sum() * 2, on_step=True, on_epoch=True)

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        pl_module.log("cb_train_epoch", float(trainer.current_epoch) + 0.25, reduce_fx="max")

    def on_validation_batch_end(self, trainer: Any, pl_module: Any, *args: Any) -> None:
        pl_module.log("cb_val_batch", pl_module.layer.weight.sum(), reduce_fx="sum")

    def on_validation_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        pl_module.log("cb_val_epoch", torch.tensor(3.5), reduce_fx="min")

    def on_test_batch_end(self, trainer: Any, pl_module: Any, *args: Any) -> None:
        pl_module.log("cb_test_batch", pl_module.layer.bias.sum() - 1)


def run_everything(
    model: pl.LightningModule, trainer_kwargs: dict[str, Any], trainer_class: type = pl.Trainer, **flag: Any
) -> tuple[pl.Trainer, dict[str, dict[str, Any]]]:
    """``fit`` (2 epochs, 2 validation loaders), then ``validate`` and ``test`` (2 loaders each); what was seen.

    Returns:
        The Trainer, and what it handed out: callback, logged and progress bar metrics after ``fit``, the results
        of ``validate`` and ``test``, the callback metrics at the end, and every ``log_metrics`` call.
    """
    torch.manual_seed(0)
    recorder = MemoryLogger()
    trainer = trainer_class(**{**trainer_kwargs, "logger": recorder}, max_epochs=2, log_every_n_steps=1, **flag)
    val_loaders = [loader(seed=1), loader(n=7, seed=2)]
    trainer.fit(model, loader(), val_loaders)
    seen = {
        "fit_callback": dict(trainer.callback_metrics),
        "fit_logged": dict(trainer.logged_metrics),
        "fit_pbar": dict(trainer.progress_bar_metrics),
    }
    validated = trainer.validate(model, val_loaders, verbose=False)
    tested = trainer.test(model, [loader(seed=3), loader(n=5, seed=4)], verbose=False)
    seen["validate"] = {f"{i}/{k}": v for i, d in enumerate(validated) for k, v in d.items()}
    seen["test"] = {f"{i}/{k}": v for i, d in enumerate(tested) for k, v in d.items()}
    seen["callback"] = dict(trainer.callback_metrics)
    seen["history"] = {f"{n}:{step}:{k}": v for n, (step, d) in enumerate(recorder.history) for k, v in d.items()}
    return trainer, seen


def all_results(trainer: Any) -> Iterator[tuple[str, Any]]:
    """Every ``(key, result)`` that the Trainer's loops keep."""
    loops = (
        trainer.fit_loop.epoch_loop,
        trainer.fit_loop.epoch_loop.val_loop,
        trainer.validate_loop,
        trainer.test_loop,
    )
    for loop in loops:
        yield from loop._results.items()


def stored_tensors(result: Any) -> Iterator[torch.Tensor]:
    """Every tensor a ``_ResultMetric`` keeps: its states, step value and computed value."""
    for name in ("value", "cumulated_batch_size", "_forward_cache", "_computed"):
        tensor = getattr(result, name, None)
        if isinstance(tensor, torch.Tensor):
            yield tensor


def assert_same(a: dict[str, Any], b: dict[str, Any]) -> None:
    """Same keys, and the same values bit for bit (tensors compared with ``torch.equal``, NaN equal to NaN)."""
    assert sorted(a) == sorted(b)
    for key in a:
        left, right = a[key], b[key]
        if isinstance(left, torch.Tensor):
            assert isinstance(right, torch.Tensor), key
            assert left.dtype == right.dtype, key
            assert torch.equal(left, right) or (left.isnan().all() and right.isnan().all()), (key, left, right)
        else:
            assert left == right, (key, left, right)


class ManualCopy:
    """A device-to-host copy that lands only when the test says so (or when waited for)."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self._source = tensor.detach().to("cpu", copy=True)
        self.host = _garbage(self._source.clone())  # what a read before landing would see
        self.landed = False
        self.waited = False
        self.released = False

    def land(self) -> None:
        self.host.copy_(self._source)
        self.landed = True

    def ready(self) -> bool:
        return self.landed

    def wait(self) -> torch.Tensor:
        self.waited = True
        if not self.landed:
            self.land()
        return self.host

    def release(self) -> None:
        self.released = True
        _garbage(self.host)  # memory handed back for reuse: a kept reference would read garbage


class ManualTransfer:
    """Checks the CPU buffer's logic on the CPU, with copies whose completion the test controls."""

    def __init__(self) -> None:
        self.copies: list[ManualCopy] = []

    def start(self, tensor: torch.Tensor, snapshot: bool = False) -> ManualCopy:
        copy = ManualCopy(tensor)
        self.copies.append(copy)
        return copy


def _garbage(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.fill_(float("nan") if tensor.is_floating_point() else -(2**31))
