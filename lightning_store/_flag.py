"""The deprecated ``move_metrics_to_cpu`` flag, put in front of the ``Trainer`` of either Lightning namespace."""

import inspect
import os
from collections.abc import Callable
from typing import Any

from pytorch_lightning.utilities.argparse import _defaults_from_env_vars

from lightning_store._policy import _as_bool
from lightning_store.mixin import StoreOnCPUMixin
from lightning_store.warnings import _deprecate_once, _warn_once

_DEPRECATION = (
    "`Trainer(move_metrics_to_cpu=True)` is deprecated and will be removed in lightning-store 1.0."
    " Use `self.log(..., store_on_cpu=True)` in a `StoreOnCPUMixin` module instead, or set"
    " `store_on_cpu_default = True` on the module. Until then the flag makes `store_on_cpu` default to True"
    " for the tensors and numbers that mixin modules log."
)


class _MoveMetricsToCPUFlag:
    """Warns when ``move_metrics_to_cpu`` has no effect; put in front of the Lightning ``Trainer``.

    The concrete class sets ``__init__ = _init_with_flag(LightningTrainer)``.
    """

    move_metrics_to_cpu: bool

    def fit(self, model: Any, *args: Any, **kwargs: Any) -> Any:
        self._warn_if_flag_has_no_effect(model)
        return super().fit(model, *args, **kwargs)  # type: ignore[misc]

    def validate(self, model: Any = None, *args: Any, **kwargs: Any) -> Any:
        self._warn_if_flag_has_no_effect(model)
        return super().validate(model, *args, **kwargs)  # type: ignore[misc]

    def test(self, model: Any = None, *args: Any, **kwargs: Any) -> Any:
        self._warn_if_flag_has_no_effect(model)
        return super().test(model, *args, **kwargs)  # type: ignore[misc]

    def _warn_if_flag_has_no_effect(self, model: Any) -> None:
        if model is None:
            model = getattr(self, "lightning_module", None)
        model = getattr(model, "_orig_mod", model)  # look through `torch.compile`'s `OptimizedModule`
        if self.move_metrics_to_cpu and model is not None and not isinstance(model, StoreOnCPUMixin):
            _warn_once(
                f"`Trainer(move_metrics_to_cpu=True)` has no effect on `{type(model).__name__}`: it only sets the"
                " default of `store_on_cpu`, which `self.log` understands in modules that use `StoreOnCPUMixin`."
                f" HINT: declare `class {type(model).__name__}(StoreOnCPUMixin, LightningModule)`.",
                stacklevel=4,
            )


def _init_with_flag(trainer_class: type) -> Callable[..., None]:
    """An ``__init__`` for a subclass of ``trainer_class`` that also takes ``move_metrics_to_cpu``.

    Its signature is the Trainer's plus the keyword-only flag, so that positional arguments, ``PL_TRAINER_*``
    environment defaults (the flag's too) and ``LightningCLI`` see every argument.
    """
    decorated_init = trainer_class.__dict__["__init__"]
    trainer_init = inspect.unwrap(decorated_init)

    @_defaults_from_env_vars
    def init_with_env_defaults(self: Any, *args: Any, move_metrics_to_cpu: Any = False, **kwargs: Any) -> None:
        # `_defaults_from_env_vars` has turned positional arguments into keywords and applied the environment
        # defaults; the Trainer's own decorated `__init__` would apply them again, `move_metrics_to_cpu` included,
        # and refuse it, so it is called undecorated.
        self.move_metrics_to_cpu = bool(_as_bool(move_metrics_to_cpu, "move_metrics_to_cpu", optional=False))
        if self.move_metrics_to_cpu:
            # 2 is this function; 3 `_defaults_from_env_vars`; 4 `__init__` below; 5 the user's `Trainer(...)` line
            _deprecate_once(_DEPRECATION, stacklevel=5)
        trainer_init(self, *args, **kwargs)

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        # Lightning reads the environment with `literal_eval` and no check; the flag is read here, strictly, so
        # that an explicit argument keeps its own strict check and a bad environment value is named as such
        if "move_metrics_to_cpu" not in kwargs:
            kwargs["move_metrics_to_cpu"] = _flag_from_environment(type(self))
        init_with_env_defaults(self, *args, **kwargs)

    signature = inspect.signature(decorated_init)
    flag = inspect.Parameter("move_metrics_to_cpu", inspect.Parameter.KEYWORD_ONLY, default=False, annotation=bool)
    __init__.__signature__ = signature.replace(parameters=[*signature.parameters.values(), flag])  # type: ignore[attr-defined]
    return __init__


_ENVIRONMENT_BOOLS = {"1": True, "true": True, "0": False, "false": False}


def _flag_from_environment(trainer_class: type) -> bool:
    """``PL_<CLASS>_MOVE_METRICS_TO_CPU``, named as Lightning names its environment defaults; ``False`` if unset.

    Accepts what Lightning's boolean flags work with from the environment: ``1``, ``0``, ``True``, ``False`` (in
    any case); anything else is an error that names the variable.
    """
    name = f"PL_{trainer_class.__name__.upper()}_MOVE_METRICS_TO_CPU"
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
