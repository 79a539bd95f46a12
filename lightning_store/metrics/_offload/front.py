"""The classes put in front of an offloaded Metric's own (and a collection's): the same Metric, run on the CPU."""

import functools
from collections.abc import Callable
from typing import Any, cast

import torch
from torch.nn import Module
from torchmetrics import Metric

from lightning_store._compat import _in_front_of
from lightning_store.metrics._configured import (
    _CPU,
    PLAIN_SETTINGS,
    _kept_on_cpu,
    _queue_of,
    _reduce_configured,
    _SettledReads,
    _sync_lists_on_device,
)
from lightning_store.metrics._gather import gather_on_device
from lightning_store.metrics._offload.inputs import _on_cpu_now
from lightning_store.metrics._offload.queue import _Queue
from lightning_store.metrics._offload.workers import _Inline, _runs_inline
from lightning_store.warnings import _warn_once_outside

# what a Metric's `update` writes besides its states (torchmetrics' wrapper), and a collection's `update`
_METRIC_BOOKKEEPING = frozenset({"_update_count", "_computed"})
_COLLECTION_BOOKKEEPING = frozenset({"_groups", "_groups_checked", "_state_is_copy"})


def _wait_for_updates(obj: Module) -> None:
    """Wait for the updates queued on ``obj`` (and raise the error one raised), unless this thread runs them."""
    queue = _queue_of(obj)
    if queue is not None and not _runs_inline():
        queue.settle()


def _set_attribute(obj: Module, set_attribute: Callable[[str, Any], None], name: str, value: Any) -> None:
    """``set_attribute(name, value)`` once the updates queued before ran: with the old value, as the plain ones.

    A worker process's copy is sent again before the next update, as after any read. ``training`` is set at once:
    Lightning's ``train()`` and ``eval()`` set it each epoch, and an update does not read it.
    """
    if name != "training":
        _wait_for_updates(obj)
    set_attribute(name, value)


def _queue_update(obj: Module, update: Callable, args: tuple, kwargs: dict) -> None:
    """Queue ``update`` on the inputs as they are now, for the worker (the caller waits only for room)."""
    cast(_Queue, _queue_of(obj)).queue_update(obj, update, args, kwargs)


def _offloading(metric: Metric, update: Callable) -> Callable:
    @functools.wraps(update)
    def queue_update(*args: Any, **kwargs: Any) -> None:
        if _runs_inline():
            update(*args, **kwargs)
        else:
            _queue_update(metric, update, args, kwargs)

    queue_update._queues = (queue_update, update)  # type: ignore[attr-defined]
    return queue_update


def _queued_update(update: Callable) -> Callable:
    """The update that :func:`_offloading` queues (``update`` if it is not such a wrapper): run as it is.

    The wrapper is told by its own attribute, which ``functools.wraps`` would copy into a wrapper of it.
    """
    queues = getattr(update, "_queues", None)
    return queues[1] if queues is not None and queues[0] is update else update


def _forward_inline(obj: Module, forward: Callable, args: tuple, kwargs: dict) -> Any:
    """``forward`` in this thread, after the updates queued before it, on the inputs copied to the CPU now."""
    name = type(obj).__name__
    _warn_once_outside(
        f"An offloaded {name} was called (its `forward`), which runs in the caller's thread, not in the offload"
        " worker: it returns the batch's value, so it waits for the updates queued before it and updates here, on"
        " the CPU. HINT: to keep its work off the step, call `metric.update(...)` in the step instead, and log"
        " the Metric object with `self.log(name, metric, on_step=False, on_epoch=True)`.",
        ("torch", "torchmetrics"),  # the user's `metric(...)` line
    )
    _wait_for_updates(obj)
    args, kwargs = _on_cpu_now(args, kwargs)
    with _Inline():
        return forward(*args, **kwargs)


class _OffloadedMetric(_SettledReads):
    """Put in front of the class of a Metric given to ``offload_to_cpu`` (see :func:`_offloaded_class`)."""

    _offload: _Queue
    _kept_attributes = ("_offload", PLAIN_SETTINGS)  # see `_compat._in_front_of`

    def _settle_states(self) -> None:
        _wait_for_updates(self)

    def _after_load(self) -> None:
        self.cpu()  # a state loaded or merged from a device comes to the CPU

    def __getattribute__(self, name: str) -> Any:
        if name in _METRIC_BOOKKEEPING or name in object.__getattribute__(self, "__dict__").get("_defaults", ()):
            _wait_for_updates(self)
        return object.__getattribute__(self, name)

    def __setattr__(self, name: str, value: Any) -> None:
        _set_attribute(self, super().__setattr__, name, value)

    def __hash__(self) -> int:
        # torchmetrics hashes the states too, which would wait for the queue at every walk of a module's children
        # (`named_modules()`, `parameters()`, `train()`): the Metric's identity is the part that makes it unique
        return hash((type(self).__name__, id(self)))

    def _wrap_update(self, update: Callable) -> Callable:
        return _offloading(self, super()._wrap_update(update))

    @torch.jit.unused
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """As the Metric's own ``forward``, on the CPU, after every update queued before it (it returns the value)."""
        if _runs_inline():
            return super().forward(*args, **kwargs)
        return _forward_inline(self, super().forward, args, kwargs)

    def reset(self) -> None:
        queue = _queue_of(self)
        if queue is not None and not _runs_inline():
            queue.resetting()
        _wait_for_updates(self)
        super().reset()

    def sync(self, dist_sync_fn: Callable | None = None, *args: Any, **kwargs: Any) -> None:
        _wait_for_updates(self)  # this process's updates are in its state before it syncs with the others
        super().sync(dist_sync_fn or self.dist_sync_fn, *args, **kwargs)

    def _sync_dist(self, dist_sync_fn: Callable = gather_on_device, process_group: Any | None = None) -> None:
        _sync_lists_on_device(self, super()._sync_dist, dist_sync_fn, process_group, _CPU)

    def _apply(self, fn: Callable, exclude_state: Any = "") -> Module:
        if _moves_nothing(fn):  # a move to a device (Lightning's on every `self.log`): the states stay as they are
            return self
        _wait_for_updates(self)
        # `keep` shows `fn` in its repr, from which torchmetrics tells a `.half()` from a `.to()`
        keep = functools.partial(_kept_on_cpu, fn, {})
        return super()._apply(keep, exclude_state) if exclude_state else super()._apply(keep)


class _OffloadedContainer(Module):
    """Put in front of a ``MetricCollection`` or ``MetricTracker`` given to ``offload_to_cpu``: one update queued."""

    _offload: _Queue
    _kept_attributes = ("_offload",)  # see `_compat._in_front_of`
    _base_class: type

    def __setattr__(self, name: str, value: Any) -> None:
        _set_attribute(self, super().__setattr__, name, value)

    def __getattribute__(self, name: str) -> Any:
        # a collection's first update forms its compute groups; after it, what the collection's own bookkeeping
        # leads to (the states it shares in a group) is read through the Metrics, which wait for their queue
        if name in _COLLECTION_BOOKKEEPING and not object.__getattribute__(self, "__dict__").get("_groups_checked"):
            _wait_for_updates(self)
        return object.__getattribute__(self, name)

    def _compute_groups_create_state_ref(self, copy: bool = False) -> None:
        # a collection's `[key]`, `items()` and `values()` share (or copy) the states of a compute group's first
        # Metric with the others: queued after the updates it must see, it keeps the step from waiting for them
        queue = _queue_of(self)
        if _runs_inline() or queue is None or not queue.ahead():
            super()._compute_groups_create_state_ref(copy)  # type: ignore[misc]
        else:
            queue.queue_call(self, "_compute_groups_create_state_ref", copy)

    def update(self, *args: Any, **kwargs: Any) -> None:
        """Queue the update of every Metric held, once, on the inputs copied once."""
        if _runs_inline():
            super().update(*args, **kwargs)  # type: ignore[misc]
        else:
            _queue_update(self, super().update, args, kwargs)  # type: ignore[misc]

    @torch.jit.unused
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """As the collection's own ``forward``, on the CPU, after every update queued before it."""
        if _runs_inline():
            return super().forward(*args, **kwargs)
        return _forward_inline(self, super().forward, args, kwargs)

    def __reduce_ex__(self, protocol: Any) -> Any:
        _wait_for_updates(self)
        return _reduce_configured(self, self.__getstate__())


_PROBED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int32, torch.int64, torch.bool)


def _moves_nothing(fn: Callable) -> bool:
    """Whether ``fn`` would leave an offloaded Metric as it is: a move to a device, or one to the CPU it is on.

    Asked of empty tensors, which copies or syncs nothing; an ``fn`` that changes any dtype, or makes a new CPU
    tensor (``to_empty``), is applied. Without waiting for the queue: Lightning moves a logged Metric to the
    device of the step on every ``self.log``.
    """
    for dtype in _PROBED_DTYPES:
        probe = torch.empty(0, dtype=dtype)
        moved = fn(probe)
        if moved.dtype != dtype or (moved.device == _CPU and moved is not probe):
            return False
    return True


def _offloaded_class(own_class: type) -> type:
    """The front class put in front of ``own_class`` (a Metric's, a collection's), made once, named as it."""
    front = _OffloadedMetric if issubclass(own_class, Metric) else _OffloadedContainer
    return _in_front_of(front, own_class)
