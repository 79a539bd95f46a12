"""``StoreOnCPUMixin``: ``self.log(..., store_on_cpu=True)`` for a LightningModule of either Lightning namespace."""

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from torch import Tensor
from torchmetrics import Metric

from lightning_store._checks import _as_bool
from lightning_store._logged.collection import _install_on, _StoringResults
from lightning_store._logged.policy import _from_log_dict, _module_policy, _requested
from lightning_store.metrics._reads import _is_offloaded, _metrics_in, _owns_list_states, _stores_states_on_cpu
from lightning_store.warnings import _said, _warn_once, _warn_once_outside

if TYPE_CHECKING:
    from pytorch_lightning import LightningModule as _LogBase
else:
    _LogBase = object

__all__ = ["StoreOnCPUMixin"]

_LIGHTNING = ("pytorch_lightning", "lightning")


class StoreOnCPUMixin(_LogBase):
    """Adds ``store_on_cpu`` to ``self.log`` and ``self.log_dict``: keep what Lightning accumulates on the CPU.

    Put it before the LightningModule (of ``pytorch_lightning`` or ``lightning.pytorch``) in the bases. A key logged
    with ``store_on_cpu=True`` keeps every tensor Lightning holds for it on the CPU: the accumulated value, the batch
    size, the step value handed to loggers and the progress bar, and the epoch value. Values are the same, bit for
    bit, as without the option. With ``sync_dist=True`` the reduction still runs on ``trainer.strategy.root_device``
    (NCCL refuses CPU tensors) and the result comes back to the CPU. On CUDA the copies are non-blocking, so the
    step does not wait for them.

    Attributes:
        store_on_cpu_default: ``store_on_cpu`` for calls that don't pass it. ``None`` (the default) defers to the
            deprecated ``Trainer(move_metrics_to_cpu=...)``, then to ``False``.

    Example:
        >>> import pytorch_lightning as pl
        >>> class LitModel(StoreOnCPUMixin, pl.LightningModule):
        ...     def training_step(self, batch, batch_idx):
        ...         loss = self.layer(batch).sum()
        ...         self.log("train_loss", loss, store_on_cpu=True)
        ...         return loss

    """

    store_on_cpu_default: bool | None = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """Refuse a class whose LightningModule comes before the mixin: its ``log`` would never reach the mixin."""
        super().__init_subclass__(**kwargs)
        mro = cls.__mro__
        lightning_log = next((c for c in mro if "log" in vars(c) and not issubclass(c, StoreOnCPUMixin)), None)
        if lightning_log is not None and mro.index(lightning_log) < mro.index(StoreOnCPUMixin):
            bases = sorted(cls.__bases__, key=lambda base: not issubclass(base, StoreOnCPUMixin))
            raise TypeError(
                f"`{cls.__name__}` puts `{lightning_log.__name__}` before `StoreOnCPUMixin` in its bases, so"
                f" `{lightning_log.__name__}.log` would run instead of the mixin's and refuse `store_on_cpu`."
                f" HINT: put the mixin first: `class {cls.__name__}({', '.join(b.__name__ for b in bases)})`."
            )

    def log(
        self,
        name: str,
        value: Metric | Tensor | int | float,
        prog_bar: bool = False,
        logger: bool | None = None,
        on_step: bool | None = None,
        on_epoch: bool | None = None,
        reduce_fx: str | Callable[[Any], Any] = "mean",
        enable_graph: bool = False,
        sync_dist: bool = False,
        sync_dist_group: Any | None = None,
        add_dataloader_idx: bool = True,
        batch_size: int | None = None,
        metric_attribute: str | None = None,
        rank_zero_only: bool = False,
        *,
        store_on_cpu: bool | None = None,
    ) -> None:
        """Log a key, value pair, as ``LightningModule.log`` does, optionally storing it on the CPU.

        Args:
            name: key to log; see ``LightningModule.log`` for this and every other argument but the last.
            value: a ``float``, ``Tensor`` or ``Metric``.
            prog_bar: show it in the progress bar.
            logger: send it to the loggers.
            on_step: log the step value.
            on_epoch: log the value accumulated over the epoch.
            reduce_fx: ``"mean"``, ``"sum"``, ``"max"`` or ``"min"``.
            enable_graph: keep the autograd graph. Lightning 2.x detaches every logged tensor anyway, so no graph
                is kept with ``store_on_cpu=True`` either: the stored value is a detached CPU copy.
            sync_dist: reduce across processes.
            sync_dist_group: the process group to reduce across.
            add_dataloader_idx: suffix the name with the dataloader index.
            batch_size: the batch size, when it can't be inferred.
            metric_attribute: the attribute that holds a logged ``Metric``.
            rank_zero_only: logged from rank zero only.
            store_on_cpu: keep the state Lightning accumulates for this key on the CPU. ``None`` takes
                ``self.store_on_cpu_default``, then ``Trainer(move_metrics_to_cpu=...)``, then ``False``.
                A ``torchmetrics.Metric`` is never moved: with ``store_on_cpu=True`` it is logged as usual, with
                a :class:`~lightning_store.StoreOnCPUWarning`; under ``store_on_cpu_default = True``, one that
                keeps list states on its device gets that warning once.

        Raises:
            TypeError: if ``store_on_cpu`` is not a bool or None.
            StorePolicyError: if the key was logged with the other ``store_on_cpu`` before.

        """
        asked = store_on_cpu
        if asked is None:
            asked = _from_log_dict.get()
        elif asked is not True and asked is not False:
            asked = _as_bool(asked, "store_on_cpu", optional=True)
        # performance: `self.log` runs every step; a call that leaves the policy to the Trainer does no more than
        # this. The Trainer's result collection applies the policy, and refuses a key's change of policy.
        policy = _module_policy(asked, self)
        token = None
        if policy is not None:
            if policy:
                self._prepare_to_store_on_cpu(name, value, warn_for_a_metric=asked is True)
            token = _requested.set(policy)
        try:
            super().log(
                name,
                value,
                prog_bar=prog_bar,
                logger=logger,
                on_step=on_step,
                on_epoch=on_epoch,
                reduce_fx=reduce_fx,
                enable_graph=enable_graph,
                sync_dist=sync_dist,
                sync_dist_group=sync_dist_group,
                add_dataloader_idx=add_dataloader_idx,
                batch_size=batch_size,
                metric_attribute=metric_attribute,
                rank_zero_only=rank_zero_only,
            )
        finally:
            if token is not None:
                _requested.reset(token)

    def log_dict(
        self,
        dictionary: Mapping[str, Metric | Tensor | int | float] | Any,
        prog_bar: bool = False,
        logger: bool | None = None,
        on_step: bool | None = None,
        on_epoch: bool | None = None,
        reduce_fx: str | Callable[[Any], Any] = "mean",
        enable_graph: bool = False,
        sync_dist: bool = False,
        sync_dist_group: Any | None = None,
        add_dataloader_idx: bool = True,
        batch_size: int | None = None,
        rank_zero_only: bool = False,
        *,
        store_on_cpu: bool | None = None,
    ) -> None:
        """Log a dictionary of values at once, as ``LightningModule.log_dict`` does, optionally on the CPU.

        Args:
            dictionary: key value pairs, or a ``torchmetrics.MetricCollection``.
            prog_bar: see :meth:`log`, as for every other argument.
            logger: see :meth:`log`.
            on_step: see :meth:`log`.
            on_epoch: see :meth:`log`.
            reduce_fx: see :meth:`log`.
            enable_graph: see :meth:`log`.
            sync_dist: see :meth:`log`.
            sync_dist_group: see :meth:`log`.
            add_dataloader_idx: see :meth:`log`.
            batch_size: see :meth:`log`.
            rank_zero_only: see :meth:`log`.
            store_on_cpu: applies to every value in ``dictionary``; see :meth:`log`.

        Raises:
            TypeError: if ``store_on_cpu`` is not a bool or None.
            StorePolicyError: as :meth:`log`.

        """
        token = _from_log_dict.set(_as_bool(store_on_cpu, "store_on_cpu", optional=True))
        try:
            super().log_dict(
                dictionary,
                prog_bar=prog_bar,
                logger=logger,
                on_step=on_step,
                on_epoch=on_epoch,
                reduce_fx=reduce_fx,
                enable_graph=enable_graph,
                sync_dist=sync_dist,
                sync_dist_group=sync_dist_group,
                add_dataloader_idx=add_dataloader_idx,
                batch_size=batch_size,
                rank_zero_only=rank_zero_only,
            )
        finally:
            _from_log_dict.reset(token)

    def _prepare_to_store_on_cpu(self, name: str, value: Any, warn_for_a_metric: bool) -> None:
        """Warn for a ``Metric``; else make the Trainer's result collections apply ``store_on_cpu``.

        Where Lightning will refuse or skip the call (no Trainer, ``predict_step``...), nothing is prepared and the
        outcome is left to Lightning.
        """
        if not isinstance(value, Tensor) and isinstance(value, Metric):  # the plain check first: it is faster
            if warn_for_a_metric:
                # `log_dict` hands each item to `self.log`: point at the user's `log_dict` line and name that call
                # (stacklevel 4 is the caller of `log`; `log_dict` adds Lightning's `log_dict` and ours above it)
                via_log_dict = _from_log_dict.get() is not None
                metric = f"<{type(value).__name__}>"
                call = f"log_dict({{..., {name!r}: {metric}}}" if via_log_dict else f"log({name!r}, {metric}"
                _warn_once(
                    f"`self.{call}, store_on_cpu=True)`: a `torchmetrics.Metric` keeps its state on its own device,"
                    " so it is logged as usual and not moved. Moving it would break its next `update` (its inputs"
                    " are on the device) and its sync across processes (NCCL refuses CPU tensors)."
                    + _metric_hint(value),
                    stacklevel=6 if via_log_dict else 4,
                )
            else:  # `store_on_cpu_default = True`: said once, if the Metric keeps list states on its device
                message = (
                    f"`{type(self).__name__}.store_on_cpu_default = True` stores on the CPU the tensors the module"
                    " logs, not the states of the Metrics it logs: those stay where the Metric updates."
                    f" {type(value).__name__} keeps what it gathers over an epoch (every prediction and target) in"
                    " list states. HINT: to keep them on the CPU, configure the Metric once where it is made,"
                    " `lightning_store.store_states_on_cpu(metric)`; then it is logged as before."
                )
                # performance: every step logs the Metric; once said, its children are not walked again
                if not _said(message) and _keeps_list_states_on_its_device(value):
                    _warn_once_outside(message, _LIGHTNING)  # the user's `self.log` or `self.log_dict` line
            return
        trainer = self._trainer
        # the training loop's collection stands for all: they are installed together (performance: three look-ups)
        installed = trainer is None or isinstance(trainer.fit_loop.epoch_loop._results, _StoringResults)
        if not installed and self._fabric is None:
            _install_on(trainer)


_LEAVE_IT = (
    "log it without `store_on_cpu`; or set `store_on_cpu_default = True` on the LightningModule, which stores every"
    " tensor it logs on the CPU and logs its Metrics as usual, and leave `store_on_cpu` out of this call."
)


def _keeps_list_states_on_its_device(metric: Metric) -> bool:
    """Whether ``metric`` holds list states (what grows over an epoch) that nothing keeps on the CPU."""
    if _is_offloaded(metric):
        return False
    holders = [m for m in _metrics_in(metric) if _owns_list_states(m)]  # on each such call: without hashing them
    return any(not _stores_states_on_cpu(m) for m in holders)


def _metric_hint(metric: Metric) -> str:
    """The HINT for a Metric logged with ``store_on_cpu=True``: only what keeps the values it logs.

    ``store_states_on_cpu`` for a Metric whose list states (what grows over an epoch) are on its device; else
    logging it without the option.
    """
    if _is_offloaded(metric):
        return " HINT: its states are on the CPU already (`offload_to_cpu`): " + _LEAVE_IT
    holders = [m for m in _metrics_in(metric) if _owns_list_states(m)]  # on each such call: without hashing them
    if not holders:
        return (
            f" {type(metric).__name__} keeps no list state (only tensors that do not grow over an epoch): there is"
            " nothing to move. HINT: " + _LEAVE_IT
        )
    if all(_stores_states_on_cpu(m) for m in holders):
        return " HINT: its list states are on the CPU already (`store_states_on_cpu`): " + _LEAVE_IT
    return (
        f" {type(metric).__name__} keeps what it gathers over an epoch (every prediction and target) in list"
        " states, on its device. HINT: to keep them on the CPU, configure the Metric once where it is made,"
        " `lightning_store.store_states_on_cpu(metric)`, and log it without `store_on_cpu`. To leave it on its"
        " device: " + _LEAVE_IT
    )
