"""What ``Trainer(move_metrics_to_cpu=True)`` does while it runs, through a callback the Trainer adds to itself."""

import inspect
import keyword
import os
import site
import sysconfig
from typing import Any

from pytorch_lightning.utilities.rank_zero import rank_zero_info
from torch.nn import Module, ModuleDict, ModuleList, Sequential
from torchmetrics import Metric

from lightning_store._checks import _as_bool, _type_name
from lightning_store._logged.collection import _install_on
from lightning_store.metrics._reads import (
    _ACCEPTED,
    _configure_together,
    _is_gather_on_device,
    _is_offloaded,
    _owns_list_states,
    _stores_states_on_cpu,
)
from lightning_store.warnings import _warn_once_at, _warn_once_outside

OPT_OUT = "move_metrics_to_cpu"  # `metric.move_metrics_to_cpu = False` leaves a Metric (or a collection) alone
# what runs between the user's `trainer.fit(...)` line and the flag's hooks
_RUNNERS = ("pytorch_lightning", "lightning", "lightning_fabric", "torch", "torchmetrics")
_WHERE_MADE = (
    "where it is made: at the end of your LightningModule's `__init__`, or, for a Metric you pass to a library's"
    " LightningModule (a `metrics=` argument, say), on that Metric before you pass it in"
)


class _MoveMetricsToCPUHooks:
    """The hooks of the callback that ``Trainer(move_metrics_to_cpu=True)`` adds to itself.

    Put in front of the ``Callback`` of the Trainer's Lightning namespace (``trainer.py``, ``lightning.py``). It
    keeps no state, so nothing of it goes into a checkpoint.
    """

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        # every module's calls go through the loops' result collections: they apply the flag. The strategy's
        # device is known by now (each rank's own under DDP), and nothing has been logged yet
        _install_on(trainer, move_metrics_to_cpu=True)

    # after `configure_model` and the strategy's move to the device; before the first batch, and any `self.log`
    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        _store_states_of_torchmetrics(pl_module)

    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        _store_states_of_torchmetrics(pl_module)

    def on_test_start(self, trainer: Any, pl_module: Any) -> None:
        _store_states_of_torchmetrics(pl_module)


def _store_states_of_torchmetrics(module: Module) -> None:
    """``store_states_on_cpu`` for every torchmetrics Metric in ``module`` with list states, said once in the log.

    Left alone: Metrics configured already (or offloaded), Metrics under an object whose ``move_metrics_to_cpu`` is
    ``False``, Metrics whose ``dist_sync_fn`` is not ``gather_on_device``, and Metrics of classes from outside
    torchmetrics (nothing can know whether their ``update`` reads their list states), which each get a warning.
    """
    left_alone: set[int] = set()
    for path, held in module.named_modules():
        if isinstance(held, _ACCEPTED) and _opts_out(held, module, path):
            left_alone.update(id(inner) for inner in held.modules())
    chosen: dict[str, Metric] = {}
    for path, metric in module.named_modules():
        if not isinstance(metric, Metric) or id(metric) in left_alone or _stores_states_on_cpu(metric):
            continue
        if _is_offloaded(metric):  # every state on the CPU already
            continue
        if not _owns_list_states(metric):
            continue
        code = _code_for(module, path)
        if type(metric).__module__.partition(".")[0] != "torchmetrics":
            _warn_own_class(metric, code)
        elif metric.dist_sync_fn is not None and not _is_gather_on_device(metric.dist_sync_fn):
            _warn_dist_sync_fn(metric, code)
        else:
            chosen[code] = metric
    if chosen:
        _configure_together(list(chosen.values()), by_flag=True)
        named = ", ".join(f"`{code}` ({type(metric).__name__})" for code, metric in chosen.items())
        rank_zero_info(
            f"`Trainer(move_metrics_to_cpu=True)` keeps the list states of {named} on the CPU, as"
            f" `lightning_store.store_states_on_cpu` does. To keep one on its device, set `{OPT_OUT} = False` on it"
            f" {_WHERE_MADE}: `{next(iter(chosen))}.{OPT_OUT} = False`."
        )


def _code_for(module: Module, path: str) -> str:
    """The Python that reaches ``module``'s submodule at ``path`` (a name from ``named_modules``) from ``self``.

    ``self.metrics[0]`` for an ``nn.ModuleList`` entry, ``self.by_stage["val"]`` for an ``nn.ModuleDict``'s (a
    ``MetricCollection``'s), ``self.auroc`` for an attribute.
    """
    code, held = "self", module
    for name in path.split(".") if path else ():
        if isinstance(held, ModuleList | Sequential) and name.isdigit():
            code += f"[{name}]"
        elif isinstance(held, ModuleDict):
            code += f'["{name}"]'
        elif name.isidentifier() and not keyword.iskeyword(name):
            code += f".{name}"
        else:
            code += f'.get_submodule("{name}")'
        held = held._modules[name]  # type: ignore[assignment]
    return code


def _opts_out(held: Module, module: Module, path: str) -> bool:
    """Whether ``held``, ``module``'s submodule at ``path``, opts out (``move_metrics_to_cpu = False``)."""
    value = getattr(held, OPT_OUT, None)
    try:
        return _as_bool(value, OPT_OUT, optional=True) is False
    except TypeError:
        code = _code_for(module, path)
        raise TypeError(
            f"Expected {code}.{OPT_OUT} to be a bool, got {value!r} ({_type_name(value)})."
            f" HINT: set `{code}.{OPT_OUT} = False` to keep it on its device under"
            " `Trainer(move_metrics_to_cpu=True)`, or leave the attribute out."
        ) from None


def _warn_own_class(metric: Metric, code: str) -> None:
    name = type(metric).__name__
    message = (
        f"`Trainer(move_metrics_to_cpu=True)` leaves the list states of `{code}` ({name}) on its device:"
        f" {name} is not a torchmetrics class, and only its author knows whether its `update` reads its list"
        " states, which would then be on the CPU. HINT: if its `update` only appends to them, configure it"
        f" {_WHERE_MADE}: `lightning_store.store_states_on_cpu({code})`. To keep it on its device and silence this"
        f" warning, set `{code}.{OPT_OUT} = False` there."
    )
    where = _where_defined(type(metric))  # a class of the user's: its definition, else the user's line
    _warn_at_users_line(message, where)


def _warn_dist_sync_fn(metric: Metric, code: str) -> None:
    message = (
        f"`Trainer(move_metrics_to_cpu=True)` leaves the list states of `{code}` ({type(metric).__name__}) on"
        f" its device: its dist_sync_fn={metric.dist_sync_fn!r} may not sync CPU states on the collective's device"
        " (NCCL refuses CPU tensors), as lightning_store.gather_on_device does. HINT: drop its dist_sync_fn to"
        f" have its list states kept on the CPU; to keep it as it is and silence this warning, set"
        f" `{code}.{OPT_OUT} = False`."
    )
    _warn_at_users_line(message, None)  # the Metric's own class is torchmetrics': the user's line


def _warn_at_users_line(message: str, where: tuple[str, int] | None) -> None:
    """Warn at ``where``, else at the user's line that runs the hooks (``trainer.fit(...)``)."""
    if where is None:
        _warn_once_outside(message, _RUNNERS)
    else:
        _warn_once_at(message, *where)


def _where_defined(cls: type) -> tuple[str, int] | None:
    """The file and line of ``cls``'s definition, if the user's code defines it; ``None`` for a library's class.

    ``None`` too where it is not to be found (a class made at run time, say).
    """
    try:
        filename, lineno = inspect.getsourcefile(cls), inspect.getsourcelines(cls)[1]
    except (OSError, TypeError):
        return None
    if not filename or _in_a_library(filename):
        return None
    return filename, lineno


def _library_roots() -> set[str]:
    """The folders where installed packages live: a class defined there is a library's, not the user's."""
    paths = sysconfig.get_paths()
    roots = {paths["purelib"], paths["platlib"], paths["stdlib"], *site.getsitepackages()}
    return {os.path.realpath(root) for root in roots}


def _in_a_library(filename: str) -> bool:
    path = os.path.realpath(filename)
    return any(os.path.commonpath([path, root]) == root for root in _library_roots())
