"""The copies of a configured Metric's list states to the CPU: started after each update, completed before reads."""

import functools
from typing import Any

import torch
from torch import Tensor
from torch.nn import Module
from torchmetrics import Metric

from lightning_store._buffer import _CopyBuffer, _transfer_for

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


def _settle(metric: Metric) -> None:
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
