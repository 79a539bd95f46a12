"""What the fronts of configured Metrics share: reads that settle first, checkpoints of the plain Metric, CPU states."""

import functools
from collections.abc import Callable
from typing import Any, cast

import torch
from torch import Tensor
from torch.nn import Module
from torchmetrics import Metric
from torchmetrics.utilities.data import dim_zero_cat

from lightning_store._compat import _in_torch_save, _plain_reduce, _remade
from lightning_store.metrics._gather import DEFAULT_CHUNK_BYTES, _gather_elements

_CPU = torch.device("cpu")


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


def _kept_on_cpu(fn: Callable, probes: dict[torch.dtype, Tensor], tensor: Tensor, moved: bool = True) -> Tensor:
    """What a state on the CPU becomes under ``fn`` (an ``_apply``'s: ``.to()``, ``.cuda()``, ``.half()``...).

    ``fn(tensor)`` where ``fn`` keeps a tensor on the CPU (a dtype, ``share_memory``) and ``moved``; else only the
    dtype ``fn`` gives, on the CPU. What ``fn`` does is asked of an empty tensor of the same dtype, once per dtype
    (``probes``), which copies or syncs nothing. A list state's element of ``store_states_on_cpu`` is not
    ``moved``: it may be a device tensor whose copy to the CPU is in flight, and takes its place when it lands.
    """
    if tensor.dtype not in probes:
        probes[tensor.dtype] = fn(torch.empty(0, dtype=tensor.dtype))
    probe = probes[tensor.dtype]
    if probe.device == _CPU and moved:
        return fn(tensor)
    return tensor if probe.dtype == tensor.dtype else tensor.to(dtype=probe.dtype)


# where an offloaded Metric (or collection) keeps its queue, in its `__dict__`
OFFLOAD = "_offload"


def _queue_of(obj: Module) -> Any:
    """The queue of ``obj`` if it was given to ``offload_to_cpu`` (or is inside what was), else ``None``."""
    return object.__getattribute__(obj, "__dict__").get(OFFLOAD)


def _list_states(metric: Metric) -> list[str]:
    return [attr for attr, default in metric._defaults.items() if isinstance(default, list)]


def _metrics_in(module: Module) -> list[Metric]:
    """``module`` if it is a Metric, and the Metrics it holds at any depth (a wrapper's, a collection's).

    Found through each Module's children, not ``modules()``, which hashes them: torchmetrics hashes a Metric by its
    states, every element of a list state included.
    """
    found = [module] if isinstance(module, Metric) else []
    for child in module._modules.values():
        if child is not None:
            found += _metrics_in(child)
    return found


def _owns_list_states(metric: Metric) -> bool:
    """Whether ``metric`` holds list states of its own (``ClasswiseWrapper`` shows those of the Metric it wraps)."""
    return any(attr in vars(metric) for attr in _list_states(metric))
