"""Which storage a logged value gets: validation of the options and resolution of ``store_on_cpu``."""

from contextvars import ContextVar
from typing import Any

__all__: list[str] = []

# `store_on_cpu` given to `log_dict`, seen by the `log` calls that Lightning's `log_dict` makes for each item
_from_log_dict: ContextVar[bool | None] = ContextVar("lightning_store_log_dict_store_on_cpu", default=None)


def _check_bool(value: Any, name: str, *, optional: bool) -> None:
    """Raise a ``TypeError`` that says how to fix ``value`` unless it is a ``bool`` (or ``None`` if ``optional``)."""
    if isinstance(value, bool) or (optional and value is None):
        return
    expected = "a bool or None" if optional else "a bool"
    raise TypeError(
        f"Expected {name} to be {expected}, got {value!r} ({type(value).__name__})."
        f" HINT: pass {name}=True or {name}=False{' (or leave it out)' if optional else ''}."
    )


def _resolve(explicit: bool | None, module: Any, trainer: Any) -> bool:
    """The explicit argument, else the module's ``store_on_cpu_default``, else ``Trainer(move_metrics_to_cpu)``."""
    if explicit is not None:
        return explicit
    module_default = module.store_on_cpu_default
    if module_default is not None:
        _check_bool(module_default, f"{type(module).__name__}.store_on_cpu_default", optional=True)
        return bool(module_default)
    return getattr(trainer, "move_metrics_to_cpu", False) is True


def _result_key(fx: str, name: str, add_dataloader_idx: bool, dataloader_idx: int | None) -> str:
    """The key under which Lightning's ``_ResultCollection.log`` stores ``name`` logged in hook ``fx``."""
    key = f"{fx}.{name}"
    if add_dataloader_idx and dataloader_idx is not None:
        key += f".{dataloader_idx}"
    return key
