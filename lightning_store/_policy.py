"""Which storage a logged value gets: validation of the options and resolution of ``store_on_cpu``."""

import sys
import weakref
from collections.abc import Iterable
from contextvars import ContextVar
from typing import Any

__all__: list[str] = []

# `store_on_cpu` given to `log_dict`, seen by the `log` calls that Lightning's `log_dict` makes for each item
_from_log_dict: ContextVar[bool | None] = ContextVar("lightning_store_log_dict_store_on_cpu", default=None)

# the module's answer for the `self.log` call that Lightning handles now (`StoreOnCPUMixin`: the argument, else
# `store_on_cpu_default`), read by the Trainer's result collection; `None` leaves it to `Trainer(move_metrics_to_cpu)`
_requested: ContextVar[bool | None] = ContextVar("lightning_store_requested", default=None)

# the Metrics that `Trainer(move_metrics_to_cpu=True)` configured, by id (a Metric's hash reads its states)
_configured_by_flag: "weakref.WeakValueDictionary[int, Any]" = weakref.WeakValueDictionary()


def _by_flag(metrics: Iterable[Any]) -> None:
    """Remember that the flag, not the user, configured ``metrics`` (for ``storage_report``)."""
    _configured_by_flag.update((id(metric), metric) for metric in metrics)


def _is_configured_by_flag(metric: Any) -> bool:
    return _configured_by_flag.get(id(metric)) is metric


def _as_bool(value: Any, name: str, *, optional: bool) -> bool | None:
    """``value`` as a ``bool`` (a ``numpy.bool_`` too) or ``None`` if ``optional``; else a ``TypeError`` that says how.

    Config systems hand out numpy booleans; numpy is not imported for them: a ``numpy.bool_`` exists only once numpy
    has been imported by someone else.
    """
    if value is True or value is False or (optional and value is None):
        return value
    numpy = sys.modules.get("numpy")
    if numpy is not None and isinstance(value, numpy.bool_):
        return bool(value)
    expected = "a bool or None" if optional else "a bool"
    raise TypeError(
        f"Expected {name} to be {expected}, got {value!r} ({_type_name(value)})."
        f" HINT: pass {name}=True or {name}=False{' (or leave it out)' if optional else ''}."
    )


def _type_name(value: Any) -> str:
    """``str`` for builtins, else the qualified name a user would import: ``numpy.int64``, ``torch.Tensor``."""
    kind = type(value)
    return kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"


def _module_policy(explicit: bool | None, module: Any) -> bool | None:
    """The explicit argument, else the module's ``store_on_cpu_default``; ``None`` leaves it to the Trainer's flag.

    The flag, ``Trainer(move_metrics_to_cpu=True)``, is read by the Trainer's result collection, which sees every
    module's calls (see :mod:`lightning_store._collection`).
    """
    if explicit is not None:
        return explicit
    default = module.store_on_cpu_default
    if default is None or default is True or default is False:  # performance: no message made on every call
        return default
    return _as_bool(default, f"{type(module).__name__}.store_on_cpu_default", optional=True)


def _check_positive_int(value: Any, name: str, hint: str) -> None:
    """Raise an error that says how to fix ``value`` (the argument ``name``) unless it is a positive ``int``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"Expected {name} to be an int, got {value!r} ({_type_name(value)}). HINT: {hint}")
    if value <= 0:
        raise ValueError(f"Expected {name} to be positive, got {value}. HINT: {hint}")
