"""The Lightning releases lightning-store is tested with, and a clear error for any other."""

import copyreg
import sys
from importlib.metadata import PackageNotFoundError, version
from typing import Any

import torch.serialization
from packaging.version import Version

# the oldest release tested (`.ci/run`), and the first minor release not yet tested
_OLDEST = Version("2.1.1")
_FIRST_UNTESTED = Version("2.7")


def _installed_version(distribution: str) -> str | None:
    """The installed version of ``distribution``, or ``None`` if it is not installed."""
    try:
        return version(distribution)
    except PackageNotFoundError:
        return None


def _check_lightning_version(distribution: str) -> None:
    """Raise an ``ImportError`` that says how to fix it if ``distribution`` is outside the tested range.

    Args:
        distribution: ``"pytorch-lightning"`` or ``"lightning"``.
    """
    installed = _installed_version(distribution)
    if installed is None:  # imported from a source tree: nothing to check
        return
    if not _OLDEST <= Version(Version(installed).base_version) < _FIRST_UNTESTED:
        raise ImportError(
            f"lightning-store supports {distribution}>={_OLDEST},<{_FIRST_UNTESTED}, but {distribution} {installed}"
            " is installed: Lightning's logging internals differ outside that range, so stored values could be"
            f" wrong. HINT: pip install '{distribution}>={_OLDEST},<{_FIRST_UNTESTED}', or a lightning-store"
            " release that supports yours."
        )


_made: dict[tuple[type, type], type] = {}  # (front, the class it is put in front of) -> the class made


def _in_front_of(front: type, base: type) -> type:
    """``front`` put in front of ``base`` (a class of either Lightning namespace, or a Metric's); made once.

    The class made knows ``base`` as ``_base_class``; pickle finds it by no name, so it pickles through
    :func:`_remade`. In front of a Lightning class it is named for both (``_StoredOnCPU_ResultMetric``). A front
    that keeps Python objects on the instance (``_kept_attributes``: a configured Metric's) is named as ``base``,
    which it stands for, and TorchScript leaves those objects alone, and ``metric_state`` (torchmetrics >= 1.1 only).
    """
    if (front, base) not in _made:
        if base.__module__.startswith("lightning."):
            _check_lightning_version("lightning")
        kept = getattr(front, "_kept_attributes", ())
        attributes: dict[str, Any] = {"_base_class": base}
        if not kept:
            name = f"{front.__name__}{base.__name__}"
        else:
            name = base.__name__
            attributes |= {
                "__module__": base.__module__,
                "__qualname__": base.__qualname__,
                "__jit_unused_properties__": [*getattr(base, "__jit_unused_properties__", []), "metric_state"],
                "__jit_ignored_attributes__": [*getattr(base, "__jit_ignored_attributes__", []), *kept],
            }
        _made[front, base] = type(name, (front, base), attributes)
    return _made[front, base]


def _remade(front: type, base: type) -> Any:
    """An empty object of the class :func:`_in_front_of` makes, made again if need be, for pickle to fill."""
    made: Any = _in_front_of(front, base)
    return made.__new__(made)


# the functions of `torch.save` that pickle what it writes (`_legacy_save`: `_use_new_zipfile_serialization=False`)
_TORCH_SAVES = frozenset(save.__code__ for save in (torch.serialization._save, torch.serialization._legacy_save))


def _in_torch_save() -> bool:
    """Whether the object being pickled now goes into a file ``torch.save`` writes: a checkpoint, say.

    Such a file may be loaded where lightning-store is not installed: a configured Metric goes into it as the plain
    Metric (see ``_SettledReads.__reduce_ex__``). Other pickles (``deepcopy``, ``ddp_spawn``, a DataLoader worker's)
    keep the configuration.
    """
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code in _TORCH_SAVES:
            return True
        frame = frame.f_back  # type: ignore[assignment]
    return False


def _plain_reduce(base: type, state: dict[str, Any]) -> tuple[Any, ...]:
    """What pickle is to write for an object of class ``base`` (a Metric's own, a collection's) holding ``state``.

    Loaded, it is ``object.__new__(base)`` given ``state`` by ``base.__setstate__``, as the plain object pickles.
    """
    return copyreg._reconstructor, (base, object, None), state  # type: ignore[attr-defined]
