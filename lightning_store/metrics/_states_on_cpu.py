"""``store_states_on_cpu``'s front: the Metric's own class, its list states copied to the CPU after each update."""

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.nn import Module
from torchmetrics import Metric

from lightning_store._buffer import _CopyBuffer, _transfer_for
from lightning_store._compat import _in_front_of
from lightning_store.metrics._configured import (
    PLAIN_SETTINGS,
    _kept_on_cpu,
    _list_states,
    _SettledReads,
    _sync_lists_on_device,
)
from lightning_store.metrics._gather import gather_on_device

_CPU = torch.device("cpu")


class _CPUStates:
    """The copies in flight of the Metrics configured together, through one :class:`~._buffer._CopyBuffer`.

    A list state element is copied to the CPU after the ``update`` that added it; once landed, its CPU copy takes
    its place in the list that holds it, so the order is kept. Not pickled: a Metric is settled before it is
    pickled, and its unpickled copy starts with none in flight.
    """

    def __init__(self, by_flag: bool = False) -> None:
        self.by_flag = by_flag  # configured by `Trainer(move_metrics_to_cpu=True)`, not by the user
        self.buffer: _CopyBuffer | None = None
        self.pending: set[int] = set()  # ids of the device tensors in flight
        self.paused = 0  # inside `forward`, which works on the batch's state

    def __getstate__(self) -> dict[str, Any]:
        return {"by_flag": False, "buffer": None, "pending": set(), "paused": 0}

    def put(self, owner: Metric, attr: str, state: list, index: int) -> None:
        tensor = state[index]
        if self.buffer is None:
            self.buffer = _CopyBuffer(_transfer_for(tensor.device))
        self.pending.add(id(tensor))
        self.buffer.put(tensor, functools.partial(self._fold, owner, attr, state, index, tensor))

    def _fold(self, owner: Metric, attr: str, state: list, index: int, tensor: Tensor, landed: Tensor) -> None:
        """Put the CPU copy where ``tensor`` is: in the owner's list now, and in the list it was added to.

        Lists are shared, not copied, by compute groups and by ``Running``'s window; ``.to()`` and ``reset`` give
        the owner a new list. A tensor found in neither was dropped (by ``reset``): its copy is not needed.
        """
        self.pending.discard(id(tensor))
        host = _host_copy(landed)
        current = getattr(owner, attr, None)
        for held in (current, state) if current is not state else (state,):
            if not isinstance(held, list):
                continue
            at = index if index < len(held) and held[index] is tensor else _find(held, tensor)
            if at is not None:
                held[at] = host

    def drain(self) -> None:
        if self.buffer is not None:
            self.buffer.drain()


def _find(state: list, tensor: Tensor) -> int | None:
    return next((i for i in range(len(state) - 1, -1, -1) if state[i] is tensor), None)


def _on_cpu(tensor: Tensor) -> bool:
    return tensor.is_cpu


def _host_copy(tensor: Tensor) -> Tensor:
    """A CPU tensor of its own: a landed copy's memory is handed back for reuse once folded."""
    return tensor.to(_CPU, copy=True)


def _collect(metric: Metric) -> None:
    """Start copying to the CPU the list state elements added on a device since the last call (no host sync)."""
    states: _CPUStates = metric._cpu_states  # type: ignore[assignment]
    if states.paused:
        return
    for attr in _list_states(metric):
        state = getattr(metric, attr)
        if not isinstance(state, list):
            continue
        added = []
        for index in range(len(state) - 1, -1, -1):  # new elements are at the end, after those in flight
            tensor = state[index]
            if not isinstance(tensor, Tensor) or _on_cpu(tensor):
                break
            if id(tensor) not in states.pending:
                added.append(index)
        for index in reversed(added):
            states.put(metric, attr, state, index)


def _land_copies(metric: Metric) -> None:
    """Fold every copy in flight, then copy any list state element still elsewhere (a loaded state, say)."""
    states: _CPUStates = metric._cpu_states  # type: ignore[assignment]
    if states.paused:
        return
    states.drain()
    for attr in _list_states(metric):
        state = getattr(metric, attr)
        if not isinstance(state, list):
            continue
        for index, tensor in enumerate(state):
            if isinstance(tensor, Tensor) and not _on_cpu(tensor):
                state[index] = _host_copy(tensor)


def _collecting(metric: Metric, update: Callable) -> Callable:
    @functools.wraps(update)
    def update_then_collect(*args: Any, **kwargs: Any) -> None:
        update(*args, **kwargs)
        _collect(metric)

    return update_then_collect


class _StatesOnCPU(_SettledReads):
    """Put in front of the class of a Metric given to ``store_states_on_cpu`` (see :func:`_class_for`)."""

    _cpu_states: _CPUStates
    _kept_attributes = ("_cpu_states", PLAIN_SETTINGS)  # see `_compat._in_front_of`

    def _settle_states(self) -> None:
        _land_copies(self)

    def _after_load(self) -> None:
        _land_copies(self)  # a state loaded or merged from a device is copied to the CPU

    def _wrap_update(self, update: Callable) -> Callable:
        return _collecting(self, super()._wrap_update(update))

    @torch.jit.unused
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """As the Metric's own ``forward``, without a host sync when that is ``Metric.forward``."""
        states = self._cpu_states
        if states.paused:
            return super().forward(*args, **kwargs)
        kept: dict[str, list] = {}
        if _forward_of(type(self)) is Metric.forward and self.full_state_update is False and not self.dist_sync_on_step:
            # torchmetrics resets the state, updates it with the batch, computes, then puts the accumulated state
            # in front: the accumulated lists are set aside and put in front again, without a copy of a tensor
            kept = {attr: getattr(self, attr) for attr in _list_states(self)}
            for attr in kept:
                setattr(self, attr, [])
        else:
            _land_copies(self)  # the update may read the accumulated state (or sync the batch's): all of it on the CPU
        states.paused += 1
        try:
            return super().forward(*args, **kwargs)
        finally:
            states.paused -= 1
            for attr, state in kept.items():  # a new list, as torchmetrics makes: compute groups share the old one
                setattr(self, attr, state + getattr(self, attr))
            _collect(self)

    def sync(
        self,
        dist_sync_fn: Callable | None = None,
        process_group: Any | None = None,
        should_sync: bool = True,
        distributed_available: Callable | None = None,
    ) -> None:
        _land_copies(self)
        super().sync(
            dist_sync_fn=dist_sync_fn or self.dist_sync_fn,
            process_group=process_group,
            should_sync=should_sync,
            distributed_available=distributed_available,
        )

    def _sync_dist(self, dist_sync_fn: Callable = gather_on_device, process_group: Any | None = None) -> None:
        device = self.device if self._cpu_states.paused else _CPU
        _sync_lists_on_device(self, super()._sync_dist, dist_sync_fn, process_group, device)

    def _apply(self, fn: Callable, exclude_state: Any = "") -> Module:
        # `.to()`, `.cuda()`, `set_dtype()`... reach every state through `fn`. The list states stay on the CPU: their
        # elements get only the dtype `fn` gives (a copy in flight first lands if that changes any).
        probes: dict[torch.dtype, Tensor] = {}
        elements = {id(t): t for t in _elements(self)}
        dtypes = {t.dtype for t in elements.values()}
        if any(_kept_on_cpu(fn, probes, torch.empty(0, dtype=d), moved=False).dtype != d for d in dtypes):
            _land_copies(self)
        keep = functools.partial(_keep_elements_on_cpu, fn, set(elements), probes)
        # `keep` shows `fn` in its repr, from which torchmetrics tells a `.half()` from a `.to()`
        return super()._apply(keep, exclude_state) if exclude_state else super()._apply(keep)


def _keep_elements_on_cpu(
    fn: Callable, elements: set[int], probes: dict[torch.dtype, Tensor], tensor: Tensor
) -> Tensor:
    """``fn(tensor)``, but a list state's element keeps its place on the CPU, with the dtype ``fn`` gives."""
    return _kept_on_cpu(fn, probes, tensor, moved=False) if id(tensor) in elements else fn(tensor)


def _elements(metric: Metric) -> list[Tensor]:
    """The tensors in the list states of ``metric``."""
    lists = [
        state for state in map(functools.partial(getattr, metric), _list_states(metric)) if isinstance(state, list)
    ]
    return [t for state in lists for t in state if isinstance(t, Tensor)]


@functools.cache
def _forward_of(metric_class: type) -> Callable:
    """The ``forward`` that the Metric's own class runs (after ``_StatesOnCPU`` in its MRO)."""
    after = metric_class.__mro__[metric_class.__mro__.index(_StatesOnCPU) + 1 :]
    return next(vars(c)["forward"] for c in after if "forward" in vars(c))


def _class_for(metric_class: type) -> type[_StatesOnCPU]:
    """``_StatesOnCPU`` put in front of ``metric_class``, made once, with the name of ``metric_class``."""
    return _in_front_of(_StatesOnCPU, metric_class)
