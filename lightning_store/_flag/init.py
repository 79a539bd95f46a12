"""The deprecated ``move_metrics_to_cpu`` flag, put in front of the ``Trainer`` of either Lightning namespace."""

import inspect
import os
from collections.abc import Callable
from typing import Any

from pytorch_lightning.utilities.argparse import _defaults_from_env_vars

from lightning_store._checks import _as_bool
from lightning_store._flag.cli import _cli_source
from lightning_store.warnings import StoreOnCPUDeprecationWarning, _warn_once_at, _warn_once_outside

# what builds a Trainer from a config between the user's line and the Trainer's `__init__` (`LightningCLI`: `_cli`)
_LAUNCHERS = ("hydra", "omegaconf", "jsonargparse")

_DEPRECATION = (
    "`Trainer(move_metrics_to_cpu=True)` is deprecated and will be removed in lightning-store 1.0."
    " Use `self.log(..., store_on_cpu=True)` in a `StoreOnCPUMixin` module instead, or set"
    " `store_on_cpu_default = True` on the module, and `lightning_store.store_states_on_cpu(metric)` for"
    " torchmetrics Metrics. Until then the flag stores on the CPU every tensor and number that a LightningModule"
    " logs, and the list states of its torchmetrics Metrics."
)


def _init_with_flag(trainer_class: type, callback_class: type) -> Callable[..., None]:
    """An ``__init__`` for a subclass of ``trainer_class`` that also takes ``move_metrics_to_cpu``.

    Its signature is the Trainer's plus the keyword-only flag, so that positional arguments, ``PL_TRAINER_*``
    environment defaults (the flag's too) and ``LightningCLI`` see every argument. With the flag, the Trainer gets
    a ``callback_class()`` (its hooks are :class:`~._move_metrics._MoveMetricsToCPUHooks`), which applies it.
    """
    decorated_init = trainer_class.__dict__["__init__"]
    trainer_init = inspect.unwrap(decorated_init)

    @_defaults_from_env_vars
    def init_with_env_defaults(self: Any, *args: Any, move_metrics_to_cpu: Any = False, **kwargs: Any) -> None:
        # `_defaults_from_env_vars` has turned positional arguments into keywords and applied the environment
        # defaults; the Trainer's own decorated `__init__` would apply them again, `move_metrics_to_cpu` included,
        # and refuse it, so it is called undecorated.
        self.move_metrics_to_cpu = bool(_as_bool(move_metrics_to_cpu, "move_metrics_to_cpu", optional=False))
        trainer_init(self, *args, **kwargs)
        if self.move_metrics_to_cpu:
            self.callbacks.append(callback_class())

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        # Lightning reads the environment with `literal_eval` and no check; the flag is read here, strictly, so
        # that an explicit argument keeps its own strict check and a bad environment value is named as such
        from_environment = "move_metrics_to_cpu" not in kwargs
        if from_environment:
            kwargs["move_metrics_to_cpu"] = _flag_from_environment(type(self))
        init_with_env_defaults(self, *args, **kwargs)
        if self.move_metrics_to_cpu:
            _deprecate_where_set(type(self) if from_environment else None)

    signature = inspect.signature(decorated_init)
    flag = inspect.Parameter("move_metrics_to_cpu", inspect.Parameter.KEYWORD_ONLY, default=False, annotation=bool)
    __init__.__signature__ = signature.replace(parameters=[*signature.parameters.values(), flag])  # type: ignore[attr-defined]
    return __init__


def _deprecate_where_set(environment_of: type | None) -> None:
    """The deprecation, at the user's line: the ``Trainer(...)`` call, or the ``LightningCLI`` config key.

    Args:
        environment_of: the Trainer class, whose ``PL_*`` variable set the flag; ``None`` if an argument did.
    """
    cli = _cli_source()
    if cli is not None:  # `LightningCLI` built the Trainer: its argument, config file or `LightningCLI(...)` line
        _warn_once_at(f"{_DEPRECATION} (set by {cli.what})", cli.filename, cli.lineno, StoreOnCPUDeprecationWarning)
    else:  # the user's `Trainer(...)` line, or the line that has a launcher build the Trainer from a config
        where = "" if environment_of is None else f" (set by the environment variable {_variable(environment_of)})"
        _warn_once_outside(_DEPRECATION + where, _LAUNCHERS, StoreOnCPUDeprecationWarning)


def _variable(trainer_class: type) -> str:
    return f"PL_{trainer_class.__name__.upper()}_MOVE_METRICS_TO_CPU"


_ENVIRONMENT_BOOLS = {"1": True, "true": True, "0": False, "false": False}


def _flag_from_environment(trainer_class: type) -> bool:
    """``PL_<CLASS>_MOVE_METRICS_TO_CPU``, named as Lightning names its environment defaults; ``False`` if unset.

    Accepts what Lightning's boolean flags work with from the environment: ``1``, ``0``, ``True``, ``False`` (in
    any case); anything else is an error that names the variable.
    """
    name = _variable(trainer_class)
    raw = os.environ.get(name, "")
    if raw == "":  # as Lightning: an empty variable is unset
        return False
    value = _ENVIRONMENT_BOOLS.get(raw.strip().lower())
    if value is None:
        raise ValueError(
            f"Expected the environment variable {name} to be 1, 0, True or False, got {raw!r}."
            f" HINT: export {name}=1 to turn move_metrics_to_cpu on, or unset it."
        )
    return value
