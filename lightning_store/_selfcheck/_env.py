"""The environment a bug report needs: Python, platform, torch and its CUDA/NCCL build, accelerators, packages."""

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
    }


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
