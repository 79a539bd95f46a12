"""``StoreOnCPUMixin``: ``self.log(..., store_on_cpu=True)`` for a LightningModule of either Lightning namespace."""

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from torch import Tensor
from torchmetrics import Metric

from lightning_store._policy import _check_bool, _from_log_dict, _resolve, _result_key
from lightning_store._result import _stored_on_cpu_class, _StoredOnCPU
from lightning_store.warnings import StorePolicyError, _warn_once

if TYPE_CHECKING:
    from pytorch_lightning import LightningModule as _LogBase
else:
    _LogBase = object

__all__ = ["StoreOnCPUMixin"]


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
                a :class:`~lightning_store.StoreOnCPUWarning`.

        Raises:
            TypeError: if ``store_on_cpu`` is not a bool or None.
            StorePolicyError: if the key was logged with the other ``store_on_cpu`` before.

        """
        _check_bool(store_on_cpu, "store_on_cpu", optional=True)
        if store_on_cpu is None:
            store_on_cpu = _from_log_dict.get()
        target = self._store_on_cpu_target(name, value, store_on_cpu, add_dataloader_idx)
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
        if target is not None:
            results, key = target
            result = results.get(key)
            if result is not None and not isinstance(result, _StoredOnCPU):
                cls = _stored_on_cpu_class(type(result))
                results[key] = cls.adopt(result, self.trainer.strategy.root_device)

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
        _check_bool(store_on_cpu, "store_on_cpu", optional=True)
        token = _from_log_dict.set(store_on_cpu)
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

    def _store_on_cpu_target(
        self, name: str, value: Any, explicit: bool | None, add_dataloader_idx: bool
    ) -> tuple[Any, str] | None:
        """The result collection and key to keep on the CPU, or ``None`` where Lightning stores the value as usual.

        Where Lightning will refuse or skip the call (no Trainer, ``barebones``, ``predict_step``...), this returns
        ``None`` and leaves the outcome to Lightning.
        """
        trainer = self._trainer
        if trainer is None or self._fabric is not None or trainer.barebones:
            return None
        results = trainer._results
        fx = self._current_fx_name
        if results is None or fx is None:
            return None
        key = _result_key(fx, name, add_dataloader_idx, results.dataloader_idx)
        if isinstance(value, Metric):
            if explicit:
                _warn_once(
                    f"`self.log({name!r}, <{type(value).__name__}>, store_on_cpu=True)`: a `torchmetrics.Metric`"
                    " keeps its state on its own device, so it is logged as usual and not moved. Moving it would"
                    " break its next `update` (its inputs are on the device) and its sync across processes (NCCL"
                    " refuses CPU tensors). HINT: drop `store_on_cpu` for Metrics, or log the tensor it computes:"
                    f" `self.log({name!r}, metric.compute(), store_on_cpu=True)`.",
                    stacklevel=4,
                )
            return None
        wanted = _resolve(explicit, self, trainer)
        stored = results.get(key)
        if stored is not None and isinstance(stored, _StoredOnCPU) is not wanted:
            raise StorePolicyError(
                f"You called `self.log({name!r}, ..., store_on_cpu={wanted})` in `{fx}` but {name!r} was logged there"
                f" before with store_on_cpu={not wanted}. A key keeps one storage policy."
                f" HINT: pass the same `store_on_cpu` on every call that logs {name!r}."
            )
        return (results, key) if wanted else None
