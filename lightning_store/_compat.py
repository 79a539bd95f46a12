"""The Lightning releases lightning-store is tested with, and a clear error for any other."""

from importlib.metadata import PackageNotFoundError, version
from typing import Any

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


_made: dict[tuple[type, type], type] = {}  # (front, Lightning's class) -> the class made


def _in_front_of(front: type, lightning_class: type) -> type:
    """``front`` put in front of ``lightning_class``, of either Lightning namespace; made once per process.

    The class made is named ``front`` + ``lightning_class`` (``_StoredOnCPU_ResultMetric``) and knows the class it
    was made for as ``_lightning_class``; pickle finds it by neither name, so it pickles through :func:`_remade`.
    """
    if (front, lightning_class) not in _made:
        if lightning_class.__module__.startswith("lightning."):
            _check_lightning_version("lightning")
        name = f"{front.__name__}{lightning_class.__name__}"
        _made[front, lightning_class] = type(name, (front, lightning_class), {"_lightning_class": lightning_class})
    return _made[front, lightning_class]


def _remade(front: type, lightning_class: type) -> Any:
    """An empty object of the class :func:`_in_front_of` makes, made again if need be, for pickle to fill."""
    made: Any = _in_front_of(front, lightning_class)
    return made.__new__(made)
