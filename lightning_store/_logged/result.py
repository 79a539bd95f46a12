"""The stored result of a key logged with ``store_on_cpu=True``: Lightning's ``_ResultMetric``, kept on the CPU."""

import sys
from typing import Any

import torch
from torch import Tensor

from lightning_store._buffer import _CopyBuffer, _transfer_for
from lightning_store._compat import _in_front_of, _remade
from lightning_store.warnings import StorePolicyError

_CPU = torch.device("cpu")


def _policy_changed(name: str, fx: str, now: bool) -> StorePolicyError:
    return StorePolicyError(
        f"You called `self.log({name!r}, ..., store_on_cpu={now})` in `{fx}` but {name!r} was logged there"
        f" before with store_on_cpu={not now}. A key keeps one storage policy."
        f" HINT: pass the same `store_on_cpu` on every call that logs {name!r}."
    )


def _to_collective_device(tensor: Tensor, device: torch.device) -> Tensor:
    """A fresh copy of ``tensor`` on ``device``, for a collective that reduces in place."""
    return tensor.to(device, copy=True)


class _StoredOnCPU:
    """Put in front of Lightning's ``_ResultMetric`` (see :func:`_stored_on_cpu_class`).

    Every tensor it keeps (accumulated value, cumulated batch size, step value, computed value) lives on the CPU.
    A logged value is copied to the CPU through a :class:`~lightning_store._buffer._CopyBuffer` and folded into the
    state once it has landed; every read of the state drains the buffer first. A reduction across processes runs on
    ``sync_device`` and its result comes back to the CPU. The collectives run when the value is logged and when the
    epoch value is computed, exactly where Lightning runs them, so every rank calls them in the same order.
    """

    # attributes of Lightning's `_ResultMetric`
    meta: Any
    value: Tensor
    cumulated_batch_size: Tensor
    _computed: Any
    _update_count: int

    # set by `adopt`
    _buffer: _CopyBuffer
    _sync_device: torch.device
    _sync_runs: bool  # whether the key is reduced across processes
    _batch_size: int = -1  # and `_batch_size_tensor`, the last batch size as a tensor (see `_as_tensor`)
    _batch_size_tensor: Tensor
    _step_value: Tensor | None = None
    _by_flag: bool = False  # stored by `Trainer(move_metrics_to_cpu=True)`, the module having left it open

    @classmethod
    def adopt(cls, result: Any, sync_device: torch.device) -> "_StoredOnCPU":
        """Take over a ``_ResultMetric`` that Lightning just registered and updated once, on ``sync_device``.

        Its state is copied to the CPU through the buffer like any later value, so the first step does not wait.

        Args:
            result: Lightning's result for the key.
            sync_device: the device of the strategy (``trainer.strategy.root_device``), where collectives run and
                where logged values come from.

        Returns:
            The result that replaces ``result`` in Lightning's result collection.
        """
        stored = cls(result.meta, True)  # type: ignore[call-arg]
        stored._sync_device = sync_device
        stored._sync_runs = _syncs(stored.meta.sync)  # Lightning keeps a key's metadata: decided once
        stored._buffer = _CopyBuffer(_transfer_for(sync_device))
        stored._buffer.put(result.value, stored._set_value)
        if stored.meta.is_mean_reduction:
            stored._buffer.put(result.cumulated_batch_size, stored._set_cumulated_batch_size)
        if result._forward_cache is not None:
            stored._buffer.put(result._forward_cache, stored._set_step_value)
        stored._update_count = result._update_count
        stored._computed = None
        return stored

    @property
    def _forward_cache(self) -> Tensor | None:
        """The step value handed to loggers and the progress bar, on the CPU."""
        self._buffer.drain()
        return self._step_value

    @_forward_cache.setter
    def _forward_cache(self, value: Tensor | None) -> None:
        self._step_value = value

    def _synced(self, tensor: Tensor) -> Tensor:
        """``tensor`` reduced across processes on the collective's device, or ``tensor`` itself if the key doesn't sync.

        The collective reduces a fresh copy in place, so the stored state is never touched.
        """
        if not self._sync_runs:
            return tensor
        return self.meta.sync(_to_collective_device(tensor, self._sync_device))

    def update(self, value: Tensor, batch_size: int) -> None:
        meta = self.meta
        if value.dtype is not torch.float32 and value.dtype is not torch.float64:
            value = _floating(value, meta)
        if not meta.on_step:
            self._buffer.put(value, lambda landed: self._accumulate(landed, batch_size))
        elif not meta.on_epoch:
            self._buffer.put(self._synced(value), self._set_step_and_value)
        elif (step_value := self._synced(value)) is value:  # no sync: one copy serves the step value and the sum
            self._buffer.put(value, lambda landed: self._set_step_value_and_accumulate(landed, batch_size))
        else:
            self._buffer.put(step_value, self._set_step_value)
            self._buffer.put(value, lambda landed: self._accumulate(landed, batch_size))

    def _accumulate(self, value: Tensor, batch_size: int) -> None:
        # the same operations, in the same order, as Lightning's `_ResultMetric.update`; the sums are taken in place
        # where no type promotion is due (the state is this result's own, made by `adopt` or `reset`): the same
        # values, without a new tensor per step
        meta = self.meta
        if meta.is_mean_reduction:
            size = self._as_tensor(batch_size)
            self._add(value * size)
            self.cumulated_batch_size.add_(size)
        elif meta.is_max_reduction or meta.is_min_reduction:
            self.value = meta.reduce_fx(self.value, value)
        elif meta.is_sum_reduction:
            self._add(value)

    def _as_tensor(self, batch_size: int) -> Tensor:
        """``batch_size`` as a CPU tensor, made again only when it changes.

        Arithmetic with a tensor is faster than with a Python number, and gives the same values: the number is
        converted to the tensor's dtype either way.
        """
        if batch_size != self._batch_size:
            self._batch_size, self._batch_size_tensor = batch_size, torch.as_tensor(batch_size)
        return self._batch_size_tensor

    def _add(self, value: Tensor) -> None:
        if value.dtype is self.value.dtype:
            self.value.add_(value)
        else:  # Lightning promotes: a float32 sum of float64 values becomes float64
            self.value = self.value + value

    def _set_value(self, value: Tensor) -> None:
        self.value = value.clone()

    def _set_cumulated_batch_size(self, value: Tensor) -> None:
        self.cumulated_batch_size = value.clone()

    def _set_step_value(self, value: Tensor) -> None:
        self._step_value = value.clone()

    def _set_step_value_and_accumulate(self, value: Tensor, batch_size: int) -> None:
        self._set_step_value(value)
        self._accumulate(value, batch_size)

    def _set_step_and_value(self, value: Tensor) -> None:
        self._step_value = value.clone()
        self.value = self._step_value

    def compute(self) -> Tensor:
        self._buffer.drain()
        value = self._synced(self.value).to(_CPU)
        if self.meta.is_mean_reduction:
            return value / self._synced(self.cumulated_batch_size).to(_CPU)
        return value.clone()

    def reset(self) -> None:
        self._buffer.drain()
        super().reset()  # type: ignore[misc]

    def to(self, *args: Any, **kwargs: Any) -> "_StoredOnCPU":
        """Stay on the CPU: Lightning moves results to the device of each logged value, and to the CPU at teardown."""
        self._buffer.drain()
        return self

    def __repr__(self) -> str:
        self._buffer.drain()
        return f"{super().__repr__()[:-1]}, stored_on='cpu')"

    def __getstate__(self) -> dict[str, Any]:
        """The state with every pending copy folded in; the buffer (CUDA streams and events) is made anew."""
        self._buffer.drain()
        state: dict[str, Any] = super().__getstate__()  # type: ignore[misc]
        return {name: value for name, value in state.items() if name != "_buffer"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)  # type: ignore[misc]
        self._buffer = _CopyBuffer(_transfer_for(self._sync_device))

    def __reduce_ex__(self, protocol: Any) -> tuple[Any, ...]:
        # the class is made at run time, so pickle could not find it by name: it is made again from Lightning's
        return _remade, (_StoredOnCPU, self._base_class), self.__getstate__()

    _base_class: type  # set on each class `_stored_on_cpu_class` makes


def _stored_on_cpu_class(result_metric_class: type) -> type[_StoredOnCPU]:
    """``_StoredOnCPU`` combined with the ``_ResultMetric`` class of the Lightning namespace in use (made once)."""
    return _in_front_of(_StoredOnCPU, result_metric_class)


def _syncs(sync: Any) -> bool:
    """Whether Lightning's ``_Sync`` calls its collective (it doesn't for ``rank_zero_only`` or one process)."""
    return bool(sync.should and not sync.rank_zero_only and sync.fn is not None)


def _floating(value: Tensor, meta: Any) -> Tensor:
    """Lightning's conversion of a logged value that is not float32 or float64, with Lightning's own warning."""
    result_module = sys.modules[type(meta).__module__]  # Lightning's `result` module, of the namespace in use
    dtype = result_module._get_default_dtype()
    if not torch.is_floating_point(value):
        result_module.warning_cache.warn(
            f"You called `self.log({meta.name!r}, ...)` in your `{meta.fx}` but the value needs to"
            f" be floating to be reduced. Converting it to {dtype}."
            " You can silence this warning by converting the value to floating point yourself."
            " If you don't intend to reduce the value (for instance when logging the global step or epoch) then"
            f" you can use `self.logger.log_metrics({{{meta.name!r}: ...}})` instead."
        )
    return value.to(dtype)
