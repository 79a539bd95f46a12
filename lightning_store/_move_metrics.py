"""What ``Trainer(move_metrics_to_cpu=True)`` does while it runs, through a callback the Trainer adds to itself."""

import inspect
from typing import Any

from pytorch_lightning.utilities.rank_zero import rank_zero_info
from torch.nn import Module
from torchmetrics import Metric

from lightning_store._collection import _install_on
from lightning_store._policy import _as_bool, _by_flag, _type_name
from lightning_store.metrics._offloaded import _is_offloaded
from lightning_store.metrics._states import _owns_list_states
from lightning_store.metrics.states import _ACCEPTED, _configure_together, _is_gather_on_device, _stores_states_on_cpu
from lightning_store.warnings import _warn_once, _warn_once_at

OPT_OUT = "move_metrics_to_cpu"  # `metric.move_metrics_to_cpu = False` leaves a Metric (or a collection) alone


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
        if isinstance(held, _ACCEPTED) and _opts_out(held, path):
            left_alone.update(id(inner) for inner in held.modules())
    chosen: dict[str, Metric] = {}
    for path, metric in module.named_modules():
        if not isinstance(metric, Metric) or id(metric) in left_alone or _stores_states_on_cpu(metric):
            continue
        if _is_offloaded(metric):  # every state on the CPU already
            continue
        if not _owns_list_states(metric):
            continue
        if type(metric).__module__.partition(".")[0] != "torchmetrics":
            _warn_own_class(metric, path)
        elif metric.dist_sync_fn is not None and not _is_gather_on_device(metric.dist_sync_fn):
            _warn_dist_sync_fn(metric, path)
        else:
            chosen[path] = metric
    if chosen:
        _configure_together(list(chosen.values()))
        _by_flag(chosen.values())
        named = ", ".join(f"`self.{path}` ({type(metric).__name__})" for path, metric in chosen.items())
        rank_zero_info(
            f"`Trainer(move_metrics_to_cpu=True)` keeps the list states of {named} on the CPU, as"
            " `lightning_store.store_states_on_cpu` does. To keep a Metric on its device, set"
            f" `metric.{OPT_OUT} = False` in your LightningModule's `__init__`."
        )


def _opts_out(held: Module, path: str) -> bool:
    value = getattr(held, OPT_OUT, None)
    try:
        return _as_bool(value, OPT_OUT, optional=True) is False
    except TypeError:
        raise TypeError(
            f"Expected self.{path}.{OPT_OUT} to be a bool, got {value!r} ({_type_name(value)})."
            f" HINT: set `self.{path}.{OPT_OUT} = False` to keep it on its device under"
            " `Trainer(move_metrics_to_cpu=True)`, or leave the attribute out."
        ) from None


def _warn_own_class(metric: Metric, path: str) -> None:
    name = type(metric).__name__
    message = (
        f"`Trainer(move_metrics_to_cpu=True)` leaves the list states of `self.{path}` ({name}) on its device:"
        f" {name} is not a torchmetrics class, and only its author knows whether its `update` reads its list"
        " states, which would then be on the CPU. HINT: if its `update` only appends to them, configure it in"
        f" your LightningModule's `__init__`: `lightning_store.store_states_on_cpu(self.{path})`; to keep it on"
        f" its device and silence this warning, set `self.{path}.{OPT_OUT} = False` there."
    )
    where = _where_defined(type(metric))
    if where is None:  # a class made at run time, say
        _warn_once(message, stacklevel=4)
    else:
        _warn_once_at(message, *where)


def _warn_dist_sync_fn(metric: Metric, path: str) -> None:
    _warn_once(
        f"`Trainer(move_metrics_to_cpu=True)` leaves the list states of `self.{path}` ({type(metric).__name__}) on"
        f" its device: its dist_sync_fn={metric.dist_sync_fn!r} may not sync CPU states on the collective's device"
        " (NCCL refuses CPU tensors), as lightning_store.gather_on_device does. HINT: drop its dist_sync_fn to"
        f" have its list states kept on the CPU; to keep it as it is and silence this warning, set"
        f" `self.{path}.{OPT_OUT} = False`.",
        stacklevel=4,  # Lightning's hook call: the Metric's own class is torchmetrics', no line of the user's
    )


def _where_defined(cls: type) -> tuple[str, int] | None:
    """The file and line of ``cls``'s definition, for a warning about it; ``None`` where not to be found."""
    try:
        filename, lineno = inspect.getsourcefile(cls), inspect.getsourcelines(cls)[1]
    except (OSError, TypeError):
        return None
    return (filename, lineno) if filename else None
