"""Tiny real fits for the self-check: quiet Trainers that write nothing outside a temporary directory."""

import contextlib
import io
import logging
import os
import socket
import warnings
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytorch_lightning as pl
import torch
from pytorch_lightning.loggers import Logger
from pytorch_lightning.plugins.environments import LightningEnvironment
from pytorch_lightning.strategies import DDPStrategy
from torch.utils.data import DataLoader, TensorDataset

from lightning_store import StoreOnCPUDeprecationWarning, StoreOnCPUWarning
from lightning_store._selfcheck._core import Context, Skip
from lightning_store._selfcheck._env import trainer_defaults

_LIGHTNING_LOGGERS = ("pytorch_lightning", "lightning.pytorch", "lightning_fabric", "lightning.fabric")
# what a launcher or a cluster sets, and what a one-process run must neither inherit nor leave behind
_RANK_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK", "GROUP_RANK")


def make_trainer(context: Context, *, ddp: bool = False, **overrides: Any) -> pl.Trainer:
    """A Trainer on ``context.accelerator`` that writes nothing: no logger, no checkpoint, root in the temp dir.

    Args:
        context: the self-check's context.
        ddp: a one-process ``ddp`` run (NCCL on CUDA, gloo on the CPU); call inside :func:`one_process_group`.
        **overrides: any other Trainer argument.
    """
    kwargs: dict[str, Any] = {
        "accelerator": context.accelerator,
        "devices": 1,
        "max_epochs": 2,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "num_sanity_val_steps": 0,
        "default_root_dir": context.root,
    }
    if ddp:
        kwargs["strategy"] = DDPStrategy(cluster_environment=LightningEnvironment(), timeout=timedelta(seconds=60))
    return pl.Trainer(**{**kwargs, **overrides})


@contextlib.contextmanager
def quiet() -> Iterator[list[str]]:
    """Keep a fit's progress bar, Lightning's info lines and warnings off the terminal.

    Yields:
        The messages of lightning-store's own warnings raised meanwhile (each once), for the check's data.
    """
    ours: list[str] = []
    levels = {name: logging.getLogger(name).level for name in _LIGHTNING_LOGGERS}
    sink = io.StringIO()
    try:
        for name in _LIGHTNING_LOGGERS:
            logging.getLogger(name).setLevel(logging.ERROR)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("ignore")
            warnings.simplefilter("always", StoreOnCPUWarning)
            warnings.simplefilter("always", StoreOnCPUDeprecationWarning)
            with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
                yield ours
            ours.extend(dict.fromkeys(str(w.message) for w in caught))
    finally:
        for name, level in levels.items():
            logging.getLogger(name).setLevel(level)


@contextlib.contextmanager
def own_defaults() -> Iterator[None]:
    """Keep the user's ``PL_TRAINER_*`` defaults out of the fits, so each check runs the fits it describes.

    Lightning applies ``PL_TRAINER_LIMIT_VAL_BATCHES=0``, say, to every Trainer, and a check would then compare
    fewer keys than it says. The variables are restored afterwards; the environment block lists them as ignored.
    """
    saved = {name: os.environ.pop(name) for name in trainer_defaults()}
    try:
        yield
    finally:
        os.environ.update(saved)


@contextlib.contextmanager
def one_process_group() -> Iterator[None]:
    """Room for a one-process ``ddp`` fit: a free loopback port, and nothing left behind after it.

    The process group is destroyed, and the environment variables and torch's thread count that Lightning sets
    are restored, so later checks run as if no distributed run had happened.

    Raises:
        Skip: if this process is already part of a process group (run the self-check on its own).
    """
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        raise Skip("this process is already in a torch.distributed process group: run the self-check on its own")
    saved = dict(os.environ)
    threads = torch.get_num_threads()
    for name in _RANK_VARIABLES:
        os.environ.pop(name, None)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(_free_port())
    try:
        yield
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        for name in set(os.environ) - set(saved):
            del os.environ[name]
        os.environ.update(saved)
        torch.set_num_threads(threads)


def batches(count: int, batch_size: int = 8, seed: int = 0) -> DataLoader:
    """``count`` batches of ``(x, y)``, the last one smaller, so a mean weighted by batch size differs."""
    generator = torch.Generator().manual_seed(seed)
    rows = (count - 1) * batch_size + batch_size // 2
    return DataLoader(TensorDataset(torch.randn(rows, 4, generator=generator), torch.randn(rows, 1)), batch_size)


def synchronize(device: torch.device) -> None:
    """Wait for ``device``, for timing: on CUDA and MPS; nothing to wait for on the CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


class MemoryLogger(Logger):
    """Keeps every ``log_metrics`` call, step by step, values as Lightning hands them over: nothing is written."""

    def __init__(self) -> None:
        super().__init__()
        self.history: list[tuple[int | None, dict[str, float]]] = []

    @property
    def name(self) -> str:
        return "lightning-store-selfcheck"

    @property
    def version(self) -> int:
        return 0

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.history.append((step, dict(metrics)))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port
