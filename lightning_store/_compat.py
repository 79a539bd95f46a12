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
