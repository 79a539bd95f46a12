"""Which storage a logged value gets: ``store_on_cpu`` resolved from the call, the module and the Trainer."""

from contextvars import ContextVar
from typing import Any

from lightning_store._checks import _as_bool

# `store_on_cpu` given to `log_dict`, seen by the `log` calls that Lightning's `log_dict` makes for each item
_from_log_dict: ContextVar[bool | None] = ContextVar("lightning_store_log_dict_store_on_cpu", default=None)

# the module's answer for the `self.log` call that Lightning handles now (`StoreOnCPUMixin`: the argument, else
# `store_on_cpu_default`), read by the Trainer's result collection; `None` leaves it to `Trainer(move_metrics_to_cpu)`
_requested: ContextVar[bool | None] = ContextVar("lightning_store_requested", default=None)


def _module_policy(explicit: bool | None, module: Any) -> bool | None:
    """The explicit argument, else the module's ``store_on_cpu_default``; ``None`` leaves it to the Trainer's flag.

    The flag, ``Trainer(move_metrics_to_cpu=True)``, is read by the Trainer's result collection, which sees every
    module's calls (see :mod:`lightning_store._logged.collection`).
    """
    if explicit is not None:
        return explicit
    default = module.store_on_cpu_default
    if default is None or default is True or default is False:  # performance: no message made on every call
        return default
    return _as_bool(default, f"{type(module).__name__}.store_on_cpu_default", optional=True)
