"""The environment a bug report needs, and what changes the fits: ``PL_*`` variables, CUDA devices, threads."""

import os
import platform
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import torch

import lightning_store


def environment() -> dict[str, str]:
    """What the self-check prints first, as ``{label: value}`` in display order."""
    return {
        "python": f"{platform.python_version()} ({platform.python_implementation()}, {sys.executable})",
        "platform": platform.platform(),
        "torch": f"{torch.__version__} (CUDA build {torch.version.cuda or 'none'}, NCCL {_nccl_version()})",
        "accelerators": ", ".join(_accelerators()),
        "pytorch-lightning": _package_version("pytorch-lightning"),
        "lightning": _package_version("lightning"),
        "torchmetrics": _package_version("torchmetrics"),
        "lightning-store": f"{lightning_store.__version__} ({Path(lightning_store.__file__).parent})",
        "PL_* variables": _lightning_variables(),
        "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", "not set"),
        "torch CPU threads": _threads(),
    }


def trainer_defaults() -> list[str]:
    """The ``PL_TRAINER_*`` variables set here: defaults that Lightning gives every Trainer it makes."""
    return sorted(name for name in os.environ if name.startswith("PL_TRAINER_"))


def _lightning_variables() -> str:
    """Every ``PL_*`` variable set, ``PL_TRAINER_*`` ones marked as ignored by the fits (:func:`_fits.own_defaults`)."""
    ignored = set(trainer_defaults())
    shown = [
        f"{name}={os.environ[name]}" + (" (ignored by the fits)" if name in ignored else "")
        for name in sorted(os.environ)
        if name.startswith("PL_")
    ]
    return ", ".join(shown) or "none set"


def _threads() -> str:
    """Torch's intra-op threads, of how many CPUs this process may use, and the variable that set them, if any."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    text = f"{torch.get_num_threads()} (of {cpus} CPUs this process may use"
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        if name in os.environ:
            text += f", {name}={os.environ[name]}"
    return text + ")"


def best_accelerator() -> str:
    """``"cuda"`` if a CUDA device is usable, else ``"mps"``, else ``"cpu"``."""
    if torch.cuda.is_available():
        return "cuda"
    if _mps_available():
        return "mps"
    return "cpu"


def _package_version(distribution: str) -> str:
    try:
        return version(distribution)
    except PackageNotFoundError:
        return "not installed"


def _nccl_version() -> str:
    if not (torch.distributed.is_available() and torch.distributed.is_nccl_available()):
        return "none"
    try:
        found = torch.cuda.nccl.version()
    except Exception as err:  # a build with NCCL but no usable library
        return f"unavailable ({type(err).__name__}: {err})"
    return ".".join(map(str, found)) if isinstance(found, tuple) else str(found)


def _accelerators() -> list[str]:
    found = []
    if torch.cuda.is_available():
        for index in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(index)
            found.append(
                f"cuda:{index} {props.name} (sm_{props.major}{props.minor}, {props.total_memory / 2**30:.0f} GiB)"
            )
    if _mps_available():
        found.append("mps")
    if not found:
        found.append("none (no CUDA or MPS device seen)")
    return found


def _mps_available() -> bool:
    mps = getattr(torch.backends, "mps", None)
    return bool(mps is not None and mps.is_available())
