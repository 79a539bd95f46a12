"""Warning and error classes of lightning-store, and the rank-zero helpers that emit them once."""

import sys
import warnings
from collections.abc import Iterable

from lightning_utilities.core.rank_zero import WarningCache, rank_zero_only

__all__ = ["StoreOnCPUDeprecationWarning", "StoreOnCPUWarning", "StorePolicyError"]


class StoreOnCPUWarning(UserWarning):
    """Warns about a ``store_on_cpu`` request that is honoured differently than asked (a ``Metric``, say).

    Example:
        >>> import warnings
        >>> warnings.filterwarnings("ignore", category=StoreOnCPUWarning)

    """


class StoreOnCPUDeprecationWarning(DeprecationWarning):
    """Warns about the deprecated ``Trainer(move_metrics_to_cpu=...)`` flag.

    Example:
        >>> import warnings
        >>> warnings.filterwarnings("error", category=StoreOnCPUDeprecationWarning)

    """


class StorePolicyError(ValueError):
    """Raised when a logged key is given two storage policies.

    Example:
        >>> try:
        ...     raise StorePolicyError("'loss' was already logged with store_on_cpu=False")
        ... except ValueError as err:
        ...     print(err)
        'loss' was already logged with store_on_cpu=False

    """


# Python hides a `DeprecationWarning` unless it is raised from `__main__`: a `Trainer` built in a module of the
# user's package, or by `LightningCLI`, would deprecate in silence. As Lightning does for its own deprecation class,
# show this one by default; the filter concerns only this class, and a filter the user adds for it takes precedence.
warnings.simplefilter("default", category=StoreOnCPUDeprecationWarning)

_cache = WarningCache()


def _warn_once(message: str, stacklevel: int = 2) -> None:
    """Warn once per message, on global rank zero, with :class:`StoreOnCPUWarning`.

    ``stacklevel`` counts as for ``warnings.warn`` called here: 2 points at the caller of ``_warn_once``.
    """
    # below this function: WarningCache.warn -> rank_zero_only's wrapper -> rank_zero_warn -> _warn
    _cache.warn(message, stacklevel=stacklevel + 4, category=StoreOnCPUWarning)


def _deprecate_once(message: str, stacklevel: int = 2) -> None:
    """Deprecate once per message, on global rank zero, with :class:`StoreOnCPUDeprecationWarning`.

    ``stacklevel`` counts as for :func:`_warn_once`.
    """
    # below this function: WarningCache.deprecation -> rank_zero_deprecation -> the four frames of `_warn_once`
    _cache.deprecation(message, stacklevel=stacklevel + 5, category=StoreOnCPUDeprecationWarning)


def _warn_once_at(message: str, filename: str, lineno: int, category: type[Warning] = StoreOnCPUWarning) -> None:
    """As :func:`_warn_once` (or :func:`_deprecate_once`, by ``category``), reported at ``filename:lineno``.

    For a warning whose cause is no line of the stack: a config file's key, the class of a Metric.
    """
    if not _said(message):
        _cache.add(message)
        _warn_explicit(message, category, filename, lineno)


@rank_zero_only
def _warn_explicit(message: str, category: type[Warning], filename: str, lineno: int) -> None:
    # no registry: the cache above shows it once per message
    warnings.warn_explicit(message, category, filename, lineno)


def _first_frame_outside(packages: Iterable[str]) -> tuple[str, int] | None:
    """The file and line of the innermost caller outside this package and ``packages`` (top-level names).

    For a warning about a line of the user's that Lightning, a launcher (Hydra...) or a library calls in between.
    ``None`` if every frame is inside them.
    """
    skipped = {"lightning_store", *packages}
    frame = sys._getframe(1)
    while frame is not None:
        module = frame.f_globals.get("__name__") or ""
        if module.partition(".")[0] not in skipped:
            return frame.f_code.co_filename, frame.f_lineno
        frame = frame.f_back  # type: ignore[assignment]
    return None


def _said(message: str) -> bool:
    """Whether ``message`` was given already (and is not to be given again)."""
    return message in _cache


def _warn_once_outside(message: str, packages: Iterable[str], category: type[Warning] = StoreOnCPUWarning) -> None:
    """As :func:`_warn_once_at`, at the innermost caller outside this package and ``packages`` (see above)."""
    if _said(message):
        return
    where = _first_frame_outside(packages)
    if where is not None:
        _warn_once_at(message, *where, category)
    elif issubclass(category, DeprecationWarning):
        _deprecate_once(message)
    else:
        _warn_once(message)
