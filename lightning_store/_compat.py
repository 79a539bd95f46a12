"""The Lightning releases lightning-store is tested with, and a clear error for any other."""

from importlib.metadata import PackageNotFoundError, version

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


def _in_front_of(front: type, lightning_class: type, made: dict[type, type]) -> type:
    """``front`` put in front of ``lightning_class``, of either Lightning namespace; made once, kept in ``made``.

    The class made is named ``front`` + ``lightning_class`` (``_StoredOnCPU_ResultMetric``) and knows the class it
    was made for as ``_lightning_class``, so that pickle can make it again in a fresh process.
    """
    if lightning_class not in made:
        if lightning_class.__module__.startswith("lightning."):
            _check_lightning_version("lightning")
        name = f"{front.__name__}{lightning_class.__name__}"
        made[lightning_class] = type(name, (front, lightning_class), {"_lightning_class": lightning_class})
    return made[lightning_class]
