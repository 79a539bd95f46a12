"""The class put in front of a configured Metric's own: the same Metric, with its list states on the CPU."""

import functools
from collections.abc import Callable
from typing import Any, cast

import torch
from torch import Tensor
from torch.nn import Module
from torchmetrics import Metric
from torchmetrics.utilities.data import dim_zero_cat

from lightning_store._compat import _in_front_of, _in_torch_save, _plain_reduce, _remade
from lightning_store.metrics._gather import DEFAULT_CHUNK_BYTES, _gather_elements, gather_on_device
from lightning_store.metrics._states import _CPU, _collect, _CPUStates, _list_states, _settle


def _collecting(metric: Metric, update: Callable) -> Callable:
    @functools.wraps(update)
    def update_then_collect(*args: Any, **kwargs: Any) -> None:
        update(*args, **kwargs)
        _collect(metric)

    return update_then_collect


def _settling(metric: Metric, compute: Callable) -> Callable:
    """``compute`` after the states of ``metric`` (a configured Metric: a ``_SettledReads``) are settled."""
    configured = cast("_SettledReads", metric)

    @functools.wraps(compute)
    def settle_then_compute(*args: Any, **kwargs: Any) -> Any:
        configured._settle_states()
        return compute(*args, **kwargs)

    return settle_then_compute


class _SettledReads(Metric):
    """The reads of a configured Metric that first settle its states, then run as the Metric's own.

    A front class (``_StatesOnCPU``, ``_OffloadedMetric``) says how to settle (``_settle_states``) and what to do
    after a state came in from elsewhere (``_after_load``: it may be on a device).
    """

    _base_class: type  # the Metric's own class: see `_compat._in_front_of`
    _kept_attributes: tuple[str, ...]  # what the front keeps on the instance, besides the Metric's own attributes

    def _settle_states(self) -> None:
        raise NotImplementedError

    def _after_load(self) -> None:
        raise NotImplementedError

    def _wrap_compute(self, compute: Callable) -> Callable:
        return _settling(self, super()._wrap_compute(compute))

    @property
    def metric_state(self) -> dict[str, list[Tensor] | Tensor]:
        self._settle_states()
        return {attr: getattr(self, attr) for attr in self._defaults}

    def state_dict(  # type: ignore[override]
        self, destination: dict[str, Any] | None = None, prefix: str = "", keep_vars: bool = False
    ) -> dict[str, Any]:
        self._settle_states()
        return super().state_dict(destination=destination, prefix=prefix, keep_vars=keep_vars)

    def _load_from_state_dict(self, *args: Any, **kwargs: Any) -> None:
        self._settle_states()
        super()._load_from_state_dict(*args, **kwargs)
        self._after_load()

    def merge_state(self, incoming_state: Any) -> None:
        # torchmetrics wants an instance of this class: the Metric's own class is as good (its state is the same)
        if isinstance(incoming_state, self._base_class):
            incoming_state = cast(Metric, incoming_state).metric_state  # a configured one settles first
        self._settle_states()
        super().merge_state(incoming_state)  # torchmetrics >= 1.1
        self._after_load()

    def __getstate__(self) -> dict[str, Any]:
        self._settle_states()
        return super().__getstate__()

    def __reduce_ex__(self, protocol: Any) -> Any:
        return _reduce_configured(self, self.__getstate__())


def _reduce_configured(obj: Any, state: dict[str, Any]) -> tuple[Any, ...]:
    """What pickle writes for ``obj``, a configured Metric or collection (its class a front's), holding ``state``.

    A file ``torch.save`` writes (a checkpoint) holds the plain object: it loads where lightning-store is not
    installed, and the code that configured it (the user's `__init__`, the flag at fit start) configures it again.
    Any other pickle makes the class again from its front and the object's own class (it is made at run time).
    """
    if _in_torch_save():
        return _plain_reduce(obj._base_class, _plain_state(state, obj._kept_attributes))
    return _remade, type(obj).__bases__, state


# where a configured Metric keeps the attributes that configuring it changed (`dist_sync_fn`...), as they were
PLAIN_SETTINGS = "_plain_settings"


def _plain_state(state: dict[str, Any], kept: tuple[str, ...]) -> dict[str, Any]:
    """``state`` of a configured object without what its front keeps, with the settings it had before (plain)."""
    plain = {name: value for name, value in state.items() if name not in kept}
    plain.update(state.get(PLAIN_SETTINGS, {}))
    return plain


def _remember_plain_settings(metric: Metric, *names: str) -> None:
    """Keep the values of ``names`` that ``metric`` has now, before they are configured: see :func:`_plain_state`."""
    metric.__dict__[PLAIN_SETTINGS] = {name: getattr(metric, name) for name in names}


class _StatesOnCPU(_SettledReads):
    """Put in front of the class of a Metric given to ``store_states_on_cpu`` (see :func:`_class_for`)."""

    _cpu_states: _CPUStates
    _kept_attributes = ("_cpu_states", PLAIN_SETTINGS)  # see `_compat._in_front_of`

    def _settle_states(self) -> None:
        _settle(self)

    def _after_load(self) -> None:
        _settle(self)  # a state loaded or merged from a device is copied to the CPU

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
            _settle(self)  # the update may read the accumulated state (or sync the batch's): all of it on the CPU
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
        _settle(self)
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
        dtypes = {dtype: _dtype_after(fn, dtype) for dtype in {t.dtype for t in _elements(self)}}
        if any(before != after for before, after in dtypes.items()):
            _settle(self)
        keep = functools.partial(_keep_on_cpu, fn, {id(t) for t in _elements(self)}, dtypes)
        # `keep` shows `fn` in its repr, from which torchmetrics tells a `.half()` from a `.to()`
        return super()._apply(keep, exclude_state) if exclude_state else super()._apply(keep)


def _sync_lists_on_device(
    metric: Metric, sync_dist: Callable, dist_sync_fn: Callable, process_group: Any | None, device: torch.device
) -> None:
    """``Metric._sync_dist`` (``sync_dist``) for a Metric whose list states live on ``device`` (the CPU, say).

    A list state reduced by ``dim_zero_cat`` is joined into one tensor, as torchmetrics does; a list state of no
    reduction (or the user's) keeps one element per item, which torchmetrics gathers element by element (so
    processes with different numbers of elements cannot sync). Those lists are gathered here, in a bounded number
    of collectives, and their elements ordered as torchmetrics orders them: the first element of every process in
    rank order, then the second... (a process with fewer elements adds none past its last). Their place in
    ``sync_dist`` is an empty list, which it leaves as it is.
    """
    dtype = getattr(metric, "_dtype", None) or torch.get_default_dtype()  # `Metric.dtype` is torchmetrics >= 1.1
    by_element, empty = {}, []
    for attr in _list_states(metric):
        state = getattr(metric, attr)
        if not isinstance(state, list):
            continue
        if metric._reductions[attr] is dim_zero_cat:
            if not state:  # a process with none joins with an empty tensor: the collectives match
                empty.append(attr)
                setattr(metric, attr, [torch.empty(0, dtype=dtype, device=device)])
            elif len(state) > 1:
                setattr(metric, attr, [dim_zero_cat(state)])
        elif all(isinstance(element, Tensor) for element in state):  # others (tuples...) are the Metric's own
            by_element[attr] = state
            setattr(metric, attr, [])
    sync_dist(dist_sync_fn, process_group=process_group)
    if not getattr(metric, "_TORCH_GREATER_EQUAL_2_1", False):  # torchmetrics 1.0 leaves a list empty everywhere
        for attr in empty:
            if getattr(metric, attr).numel() == 0:
                setattr(metric, attr, [])
    group = process_group or metric.process_group or torch.distributed.group.WORLD
    chunk_bytes = getattr(metric.dist_sync_fn, "keywords", {}).get("chunk_bytes", DEFAULT_CHUNK_BYTES)
    for attr, state in by_element.items():
        gathered = _gather_elements(state, group, chunk_bytes)
        ordered = [each[i] for i in range(max(map(len, gathered))) for each in gathered if i < len(each)]
        reduction = cast(Callable | None, metric._reductions[attr])  # `add_state` made a name a function
        setattr(metric, attr, reduction(ordered) if reduction is not None and ordered else ordered)


def _elements(metric: Metric) -> list[Tensor]:
    """The tensors in the list states of ``metric``."""
    lists = [
        state for state in map(functools.partial(getattr, metric), _list_states(metric)) if isinstance(state, list)
    ]
    return [t for state in lists for t in state if isinstance(t, Tensor)]


def _dtype_after(fn: Callable, dtype: torch.dtype) -> torch.dtype:
    """The dtype ``fn`` gives a tensor of ``dtype``: asked of an empty tensor, which no device copies or syncs for."""
    return fn(torch.empty(0, dtype=dtype)).dtype


def _keep_on_cpu(fn: Callable, elements: set[int], dtypes: dict[torch.dtype, torch.dtype], tensor: Tensor) -> Tensor:
    if id(tensor) not in elements:
        return fn(tensor)
    after = dtypes[tensor.dtype]
    return tensor if after == tensor.dtype else tensor.to(dtype=after)


@functools.cache
def _forward_of(metric_class: type) -> Callable:
    """The ``forward`` that the Metric's own class runs (after ``_StatesOnCPU`` in its MRO)."""
    after = metric_class.__mro__[metric_class.__mro__.index(_StatesOnCPU) + 1 :]
    return next(vars(c)["forward"] for c in after if "forward" in vars(c))


def _class_for(metric_class: type) -> type[_StatesOnCPU]:
    """``_StatesOnCPU`` put in front of ``metric_class``, made once, with the name of ``metric_class``."""
    return _in_front_of(_StatesOnCPU, metric_class)
