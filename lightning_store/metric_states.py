"""``store_states_on_cpu``: a torchmetrics ``Metric`` whose list states live on the CPU, synced on the device."""

import functools
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
from torch import Tensor
from torch.nn import Module
from torchmetrics import Metric, MetricCollection
from torchmetrics.utilities.data import dim_zero_cat

from lightning_store._buffer import _CopyBuffer, _transfer_for
from lightning_store._gather import DEFAULT_CHUNK_BYTES, _check_chunk_bytes, gather_on_device
from lightning_store.warnings import _warn_once

__all__ = ["gather_on_device", "store_states_on_cpu"]

_MetricOrCollection = TypeVar("_MetricOrCollection", Metric, MetricCollection)
_CPU = torch.device("cpu")


class _CPUStates:
    """The copies in flight of the Metrics configured together (a ``MetricCollection``'s share one, as their states).

    A list state element is copied to the CPU through a :class:`~lightning_store._buffer._CopyBuffer`; once landed,
    it replaces the device tensor at its place in the list of every member that holds it, so the order is kept.
    Not pickled: a Metric is settled before it is pickled, and its unpickled copy starts with none in flight.
    """

    def __init__(self) -> None:
        self.members: list[Metric] = []
        self.buffer: _CopyBuffer | None = None
        self.pending: set[int] = set()  # ids of the device tensors in flight
        self.paused = 0  # inside `forward`, which works on the batch's state

    def __getstate__(self) -> dict[str, Any]:
        return {"members": [], "buffer": None, "pending": set(), "paused": 0}

    def put(self, attr: str, index: int, tensor: Tensor) -> None:
        if self.buffer is None:
            self.buffer = _CopyBuffer(_transfer_for(tensor.device))
        self.pending.add(id(tensor))
        self.buffer.put(tensor, functools.partial(self._fold, attr, index, tensor))

    def _fold(self, attr: str, index: int, tensor: Tensor, landed: Tensor) -> None:
        self.pending.discard(id(tensor))
        host = _host_copy(landed)
        seen: set[int] = set()  # members of a compute group share their lists
        for member in self.members:
            state = getattr(member, attr, None)
            if isinstance(state, list) and id(state) not in seen:
                seen.add(id(state))
                if not (index < len(state) and state[index] is tensor):
                    index = next((i for i in range(len(state) - 1, -1, -1) if state[i] is tensor), len(state))
                if index < len(state):
                    state[index] = host

    def drain(self) -> None:
        if self.buffer is not None:
            self.buffer.drain()


def _on_cpu(tensor: Tensor) -> bool:
    return tensor.is_cpu


def _host_copy(tensor: Tensor) -> Tensor:
    """A CPU tensor of its own: a landed copy's memory is handed back for reuse once folded."""
    return tensor.to(_CPU, copy=True)


def _list_states(metric: Metric) -> list[str]:
    return [attr for attr, default in metric._defaults.items() if isinstance(default, list)]


def _collect(metric: Metric) -> None:
    """Start copying to the CPU the list state elements added on a device since the last call (no host sync)."""
    states: _CPUStates = metric._cpu_states  # type: ignore[assignment]
    if states.paused:
        return
    for attr in _list_states(metric):
        state = getattr(metric, attr)
        added = []
        for index in range(len(state) - 1, -1, -1):  # new elements are at the end, after those in flight
            tensor = state[index]
            if not isinstance(tensor, Tensor) or _on_cpu(tensor):
                break
            if id(tensor) not in states.pending:
                added.append(index)
        for index in reversed(added):
            states.put(attr, index, state[index])


def _settle(metric: Metric) -> None:
    """Fold every copy in flight, then copy any list state element still elsewhere (a loaded state, say)."""
    states: _CPUStates = metric._cpu_states  # type: ignore[assignment]
    if states.paused:
        return
    states.drain()
    for attr in _list_states(metric):
        state = getattr(metric, attr)
        for index, tensor in enumerate(state):
            if isinstance(tensor, Tensor) and not _on_cpu(tensor):
                state[index] = _host_copy(tensor)


def _collecting(metric: Metric, update: Callable) -> Callable:
    @functools.wraps(update)
    def update_then_collect(*args: Any, **kwargs: Any) -> None:
        update(*args, **kwargs)
        _collect(metric)

    return update_then_collect


def _settling(metric: Metric, compute: Callable) -> Callable:
    @functools.wraps(compute)
    def settle_then_compute(*args: Any, **kwargs: Any) -> Any:
        _settle(metric)
        return compute(*args, **kwargs)

    return settle_then_compute


class _StatesOnCPU(Metric):
    """Put in front of the class of a Metric given to :func:`store_states_on_cpu` (see :func:`_class_for`)."""

    _cpu_states: _CPUStates

    def _wrap_update(self, update: Callable) -> Callable:
        return _collecting(self, super()._wrap_update(update))

    def _wrap_compute(self, compute: Callable) -> Callable:
        return _settling(self, super()._wrap_compute(compute))

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """As ``Metric.forward``, without a host sync: the batch value is computed on the batch's device."""
        states = self._cpu_states
        if states.paused:
            return super().forward(*args, **kwargs)
        if self.full_state_update or self.full_state_update is None or self.dist_sync_on_step:
            # `update` may read the accumulated state: it gets all of it, on the CPU
            _settle(self)
            kept = {}
        else:
            # torchmetrics resets the state, updates it with the batch, computes, then appends the accumulated
            # state in front: the accumulated list states are set aside and put in front again, without a copy
            kept = {attr: getattr(self, attr) for attr in _list_states(self)}
            for attr in kept:
                setattr(self, attr, [])
        states.paused += 1
        try:
            return super().forward(*args, **kwargs)
        finally:
            states.paused -= 1
            for attr, state in kept.items():
                setattr(self, attr, state + getattr(self, attr))
            _collect(self)

    def reset(self) -> None:
        if not self._cpu_states.paused:
            self._cpu_states.drain()  # the pinned memory of a copy in flight is reused once it has landed
        super().reset()

    def sync(
        self,
        dist_sync_fn: Callable | None = None,
        process_group: Any | None = None,
        should_sync: bool = True,
        distributed_available: Callable | None = None,
    ) -> None:
        _settle(self)
        super().sync(
            dist_sync_fn=dist_sync_fn or self.dist_sync_fn,
            process_group=process_group,
            should_sync=should_sync,
            distributed_available=distributed_available,
        )

    def _sync_dist(self, dist_sync_fn: Callable = gather_on_device, process_group: Any | None = None) -> None:
        # one gather per list state, whatever the number of elements on each process: torchmetrics gathers the
        # elements of a state without reduction one by one, and 1.0 skips the gather of a process with none, so
        # processes with different numbers of updates would not call the same collectives
        device = self.device if self._cpu_states.paused else _CPU
        dtype = getattr(self, "_dtype", None) or torch.get_default_dtype()  # `Metric.dtype` is torchmetrics >= 1.1
        for attr in _list_states(self):
            state = getattr(self, attr)
            if self._reductions[attr] in (dim_zero_cat, None) and len(state) != 1:
                setattr(self, attr, [dim_zero_cat(state)] if state else [torch.empty(0, dtype=dtype, device=device)])
        super()._sync_dist(dist_sync_fn, process_group=process_group)

    def state_dict(  # type: ignore[override]
        self, destination: dict[str, Any] | None = None, prefix: str = "", keep_vars: bool = False
    ) -> dict[str, Any]:
        _settle(self)
        return super().state_dict(destination=destination, prefix=prefix, keep_vars=keep_vars)

    def _load_from_state_dict(self, *args: Any, **kwargs: Any) -> None:
        _settle(self)
        super()._load_from_state_dict(*args, **kwargs)
        _settle(self)

    def merge_state(self, incoming_state: Any) -> None:
        _settle(self)
        if isinstance(incoming_state, _StatesOnCPU):
            _settle(incoming_state)
        super().merge_state(incoming_state)  # torchmetrics >= 1.1
        _settle(self)

    def _apply(self, fn: Callable, exclude_state: Sequence[str] = "") -> Module:
        if self._dtype_convert:  # `set_dtype` converts every state, on the CPU for list states
            _settle(self)
            return super()._apply(fn, exclude_state)
        excluded = [exclude_state] if isinstance(exclude_state, str) and exclude_state else list(exclude_state)
        return super()._apply(fn, exclude_state=[*excluded, *_list_states(self)])

    def __getstate__(self) -> dict[str, Any]:
        _settle(self)
        return super().__getstate__()

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self._cpu_states.members.append(self)

    def __reduce_ex__(self, protocol: Any) -> tuple[Any, ...]:
        # the class is made at run time: pickle rebuilds it from the Metric's own class, which it finds by name
        return _rebuild, (_bases[type(self)],), self.__getstate__()


_classes: dict[type, type[_StatesOnCPU]] = {}
_bases: dict[type, type] = {}


def _class_for(metric_class: type) -> type[_StatesOnCPU]:
    """``_StatesOnCPU`` put in front of ``metric_class``, made once, with the name of ``metric_class``."""
    if metric_class not in _classes:
        names = {"__module__": metric_class.__module__, "__qualname__": metric_class.__qualname__}
        made = type(metric_class.__name__, (_StatesOnCPU, metric_class), names)
        _classes[metric_class] = made
        _bases[made] = metric_class
    return _classes[metric_class]


def _rebuild(metric_class: type) -> _StatesOnCPU:
    """An empty configured Metric of ``metric_class``, for pickle to fill in with ``__setstate__``."""
    made = _class_for(metric_class)
    return made.__new__(made)


def _is_gather_on_device(fn: Any) -> bool:
    return fn is gather_on_device or (isinstance(fn, functools.partial) and fn.func is gather_on_device)


def _configure(metric: Metric, states: _CPUStates, chunk_bytes: int) -> None:
    if not _is_gather_on_device(metric.dist_sync_fn) and metric.dist_sync_fn is not None:
        raise ValueError(
            f"store_states_on_cpu() got a {type(metric).__name__} with dist_sync_fn={metric.dist_sync_fn!r}: its"
            " list states live on the CPU, and their sync must copy them to the collective's device (NCCL refuses"
            " CPU tensors), which lightning_store.gather_on_device does and another function may not."
            " HINT: drop dist_sync_fn; store_states_on_cpu sets it to gather_on_device."
        )
    if isinstance(metric, _StatesOnCPU):
        if metric._cpu_states is not states:  # now configured with the rest of a collection
            _settle(metric)
            metric._cpu_states.members.remove(metric)
            metric._cpu_states = states
            states.members.append(metric)
    else:
        if not _list_states(metric):
            _warn_once(
                f"store_states_on_cpu() got a {type(metric).__name__}, which has no list state: there is nothing to"
                " move to the CPU. Its tensor states (sums, counts, maxima...) are a few bytes and stay where it"
                " computes. HINT: store_states_on_cpu is for Metrics that keep every prediction of an epoch, such as"
                " BinaryAUROC(thresholds=None); leave this one as it is.",
                stacklevel=4,  # the user's line: above `_configure` and `store_states_on_cpu`
            )
        metric.compute_on_cpu = False  # superseded: its blocking copies after each update are not needed
        metric.__class__ = _class_for(type(metric))
        metric._cpu_states = states
        states.members.append(metric)
        metric.update = _collecting(metric, metric.update)  # type: ignore[method-assign]
        metric.compute = _settling(metric, metric.compute)  # type: ignore[method-assign]
    metric.dist_sync_fn = functools.partial(gather_on_device, chunk_bytes=chunk_bytes)
    _collect(metric)  # what it gathered on a device before


def store_states_on_cpu(metric: _MetricOrCollection, *, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> _MetricOrCollection:
    """Keep the list states of ``metric`` on the CPU, without a host sync per update; sync them on the device.

    List states are what grows over an epoch: every prediction and target of ``BinaryAUROC(thresholds=None)``,
    ``BinaryAveragePrecision(thresholds=None)``, ``SpearmanCorrCoef``, the retrieval metrics or ``CatMetric``. After
    each ``update`` (and ``forward``), the elements it added are copied to the CPU through the same non-blocking
    buffer as ``self.log(..., store_on_cpu=True)`` (pinned memory, a side stream, events on CUDA) and replace the
    device tensors in place, in order. Every read (``compute``, ``sync``, ``state_dict``, ``reset``, pickling,
    ``merge_state``, a ``forward`` of a Metric whose ``update`` reads its whole state) first completes the copies
    in flight. Tensor states (sums, counts, maxima) are a few bytes: they stay where the Metric computes.

    Nothing moves the list states back: not ``.to(device)`` or ``.cuda()`` on the Metric or its module, not the
    ``.to(value.device)`` that Lightning runs on every ``self.log``, not Lightning's teardown. The Metric's
    ``.device`` stays the device its inputs come from. ``compute`` runs on the CPU, as with ``compute_on_cpu=True``,
    which this supersedes. Across processes the list states are gathered by :func:`gather_on_device`, on
    ``torch.cuda.current_device()`` under NCCL (on the CPU under gloo), in chunks of at most ``chunk_bytes``, and the
    result comes back to the CPU; the Metric's ``dist_sync_fn`` is set to it.

    The Metric is configured in place: its class becomes a subclass of its own class, which pickles, deep-copies
    and unpickles in a fresh process like the Metric itself. Calling this again only sets ``chunk_bytes``.

    Args:
        metric: a ``torchmetrics.Metric``, or a ``MetricCollection`` whose metrics are all configured (with
            compute groups, their shared states stay shared). Metrics added to the collection later are not.
        chunk_bytes: the most device memory a chunk of the gather takes, when processes sync.

    Returns:
        ``metric`` itself.

    Raises:
        TypeError: if ``metric`` is neither a ``Metric`` nor a ``MetricCollection``, or ``chunk_bytes`` is not an
            int.
        ValueError: if ``chunk_bytes`` is not positive, or the Metric has a ``dist_sync_fn`` of its own (the sync
            of CPU states needs :func:`gather_on_device`).

    Example:
        >>> import torch
        >>> from torchmetrics.classification import BinaryAUROC
        >>> auroc = store_states_on_cpu(BinaryAUROC(thresholds=None))
        >>> auroc.update(torch.tensor([0.1, 0.8, 0.4]), torch.tensor([0, 1, 1]))
        >>> auroc.preds[0].device, auroc.compute()
        (device(type='cpu'), tensor(1.))

    """
    _check_chunk_bytes(chunk_bytes)
    if isinstance(metric, MetricCollection):
        members = [m for m in metric._modules.values() if isinstance(m, Metric)]
    elif isinstance(metric, Metric):
        members = [metric]
    else:
        raise TypeError(
            f"store_states_on_cpu() takes a torchmetrics Metric or MetricCollection, got {type(metric).__name__}."
            " HINT: pass the Metric itself, as in `self.auroc = store_states_on_cpu(BinaryAUROC(thresholds=None))`."
        )
    configured = [m._cpu_states for m in members if isinstance(m, _StatesOnCPU)]
    states = configured[0] if configured else _CPUStates()
    for member in members:
        _configure(member, states, chunk_bytes)
    return metric


def _stores_states_on_cpu(metric: Metric) -> bool:
    """Whether ``metric`` was given to :func:`store_states_on_cpu`."""
    return isinstance(metric, _StatesOnCPU)


def _settle_states(metric: Metric) -> None:
    """Complete the copies in flight of a Metric given to :func:`store_states_on_cpu`: before reading its states."""
    if isinstance(metric, _StatesOnCPU):
        _settle(metric)
