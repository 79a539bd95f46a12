"""The warnings an update gives in the worker: kept, and given again in the caller's thread at its next call."""

import sys
import threading
import warnings
from types import FrameType
from typing import Any

_kept = threading.local()  # `log`: the warnings of the update the worker runs now (a list), else absent
_shown: Any = None  # `warnings._showwarnmsg` as it was before `_install`
# frames of these packages stand between the user's line and the call that gives a kept warning again
_LIBRARIES = ("lightning_store", "torchmetrics", "torch", "pytorch_lightning", "lightning", "lightning_utilities")


def _show_or_keep(message: warnings.WarningMessage) -> None:
    """``warnings._showwarnmsg`` while a worker runs: a warning of the worker's update is kept, any other shown."""
    log = getattr(_kept, "log", None)
    if log is None:
        _shown(message)
    else:
        log.append(message)


def _install() -> None:
    """Route warnings through :func:`_show_or_keep` (when the worker starts).

    Python shows a warning through ``warnings._showwarnmsg``, a function of the process, and ``catch_warnings``
    (pytest's, the user's) swaps what it calls, never it: so a warning of another thread is shown as it would be
    (by ``catch_warnings`` too), and one of an update in the worker is kept for the caller.
    """
    global _shown
    if warnings._showwarnmsg is not _show_or_keep:  # type: ignore[attr-defined]
        _shown = warnings._showwarnmsg  # type: ignore[attr-defined]
        warnings._showwarnmsg = _show_or_keep  # type: ignore[attr-defined]


def _uninstall() -> None:
    """Put back what :func:`_install` replaced, unless something replaced it since (at exit)."""
    if warnings._showwarnmsg is _show_or_keep:  # type: ignore[attr-defined]
        warnings._showwarnmsg = _shown  # type: ignore[attr-defined]


class _KeptWarnings:
    """``with _KeptWarnings() as kept:`` keeps the warnings this thread (the worker) gives in the block in ``kept``.

    They are not shown. A class, not a generator: a worker process enters one at every update.
    """

    __slots__ = ("log", "outer")

    def __enter__(self) -> list[warnings.WarningMessage]:
        self.log: list[warnings.WarningMessage] = []
        self.outer = getattr(_kept, "log", None)
        _kept.log = self.log
        return self.log

    def __exit__(self, *exc: object) -> None:
        _kept.log = self.outer


def _warn_again(message: warnings.WarningMessage, source: str) -> None:
    """Give ``message`` again, in this thread, at the user's line that called in, saying it came from ``source``."""
    text = f"{message.message} (given by {source}, which ran in lightning-store's offload worker)"
    frame = _users_frame()
    registry = frame.f_globals.setdefault("__warningregistry__", {})
    module = frame.f_globals.get("__name__", "<unknown>")
    warning: Any = text
    try:
        message.category(text)
    except Exception:  # a warning class that takes other arguments: given as it was
        warning = message.message
    warnings.warn_explicit(warning, message.category, frame.f_code.co_filename, frame.f_lineno, module, registry)


def _users_frame() -> FrameType:
    """The innermost frame of the stack outside the libraries between the user and lightning-store."""
    frame = sys._getframe(1)
    while frame.f_back is not None and frame.f_globals.get("__name__", "").split(".")[0] in _LIBRARIES:
        frame = frame.f_back
    return frame
