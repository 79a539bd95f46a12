"""The defaults of an object's Metrics that the worker process holds: sent again as references, not as bytes.

After a read, the worker process gets the whole object again before its next update (the object here is the one
that counts). torchmetrics keeps a copy of each state's default (``_defaults``), and ``reset()`` sets each state to
a copy of it: sent as bytes, a ``MulticlassConfusionMatrix(1000)`` after ``compute()`` and ``reset()`` is 16 MB,
the default and the state. The worker process holds the default already, as it was last sent: a default unchanged
here since then, and a state equal to it bit for bit, go as a reference to it (a few bytes), from which the worker
process makes the same tensor the bytes would have made (``pickling._tensor``).

A default is unchanged while it is the same tensor at the same version (``Tensor._version``, which every in-place
op counts): torchmetrics replaces a default (``_apply``), never changes it in place. The worker process checks its
own the same way at each read; one an update changed, added or replaced there comes back with the states (with
``_persistent`` and ``_reductions``, which ``add_state`` writes with it), so that here it is as there.
"""

from typing import Any

import torch
from torch import Tensor
from torch.nn import Module

from lightning_store.metrics._offload.process.pickling import _memory_of, _plain, _tensor

# a reference: ("default" or "state", the Module's index in `modules()`, the state's name, strides, inference)
_Reference = tuple[str, int, str, tuple[int, ...], bool]  # hashable: see `pickling._Resolving`
# the defaults held, by the Module's index and the state's name: the default, and its version then (a tensor's)
_Held = dict[tuple[int, str], tuple[Any, int]]
_ADDED_WITH_A_STATE = ("_defaults", "_persistent", "_reductions")


def _held(obj: Module) -> _Held:
    """The defaults of ``obj``'s Modules, as they are now."""
    return {
        (index, name): (default, default._version if isinstance(default, Tensor) else 0)
        for index, module in enumerate(obj.modules())
        for name, default in vars(module).get("_defaults", {}).items()
    }


class _SentDefaults:
    """The defaults of ``root``'s Modules as the worker process got them in its copy (forgotten when it ends)."""

    def __init__(self, root: Module) -> None:
        self.modules = list(root.modules())
        self.held = _held(root)

    def references(self, root: Module) -> dict[int, _Reference]:
        """The tensors of ``root`` to send as references (by ``id``): a default it holds, and a state equal to it."""
        modules = list(root.modules())
        if len(modules) != len(self.modules):
            return {}
        if any(module is not held for module, held in zip(modules, self.modules, strict=True)):
            return {}
        known: dict[int, _Reference] = {}
        for (index, name), (default, version) in self.held.items():
            data = vars(modules[index])
            if data.get("_defaults", {}).get(name) is not default or not isinstance(default, Tensor):
                continue  # replaced here (sent as bytes), or a list state's (`reset()` reads only its type)
            if default._version != version or not _referable(default):
                continue  # changed here: sent as bytes
            known.setdefault(id(default), ("default", index, name, default.stride(), default.is_inference()))
            state = data.get(name)
            if isinstance(state, Tensor) and id(state) not in known and _same_bits(state, default):
                known[id(state)] = ("state", index, name, state.stride(), state.is_inference())
        return known


def _same(held: tuple[Any, int], default: Any, version: int) -> bool:
    return held[0] is default and held[1] == version


def _referable(tensor: Tensor) -> bool:
    return type(tensor) is Tensor and _plain(tensor) and tensor.is_contiguous()


def _same_bits(state: Tensor, default: Tensor) -> bool:
    """Whether ``state`` holds ``default``'s bytes in the same dtype and shape (``-0.0`` is not ``0.0``, NaN is NaN)."""
    if not _referable(state) or state.dtype != default.dtype or state.shape != default.shape:
        return False
    return torch.equal(_bits(state), _bits(default))


# a floating, complex or bool tensor's bits, as integers of its element's size (compared 8 bytes at a time at most)
_AS_INTEGERS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64, 16: torch.int64}


def _bits(tensor: Tensor) -> Tensor:
    """A contiguous ``tensor`` as 1-D integers that are equal where its bits are (an integer tensor as it is)."""
    flat = tensor.reshape(-1)
    if tensor.is_floating_point() or tensor.is_complex() or tensor.dtype == torch.bool:
        return flat.view(_AS_INTEGERS[tensor.element_size()])
    return flat


def _made_from(held: _Held, reference: _Reference) -> Tensor:
    """The tensor a reference stands for, made from the default held (in the worker process)."""
    _, index, name, stride, inference = reference
    default, version = held[(index, name)]
    if default._version != version:  # checked at each read, which comes before the object is sent again
        raise RuntimeError(f"the default of {name!r} changed in the worker process since it was sent (a bug)")
    return _tensor(_memory_of(default), default.dtype, tuple(default.shape), stride, inference)


def _changed_defaults(obj: Module, held: _Held) -> list[dict[str, Any]]:
    """For each of ``obj``'s Modules, what of its defaults changed since ``held`` (to come back with its states)."""
    now = _held(obj)
    changed = {index for index, _ in now.keys() ^ held.keys()}  # a state added, or a Module
    changed |= {at[0] for at, (default, version) in now.items() if at in held and not _same(held[at], default, version)}
    return [
        {key: data[key] for key in _ADDED_WITH_A_STATE if key in data} if index in changed else {}
        for index, data in enumerate(map(vars, obj.modules()))
    ]
