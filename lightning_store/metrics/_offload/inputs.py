"""An update's inputs, taken as they are at the call: copied to the CPU through the buffer's transfer, landed later."""

from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor

from lightning_store._buffer import _Copy, _Landed, _transfer_for
from lightning_store.metrics._offload.layout import as_passed, flags, misalignment, spanned, unflagged

# torch < 2.4 fails an op on a tensor subclass under a dispatch mode, as the worker thread's guard is
_SUBCLASSES_UNDER_A_MODE = tuple(int(part) for part in torch.__version__.split(".")[:2]) >= (2, 4)
_POOL_SIZE = 16  # CPU buffers kept per dtype and length
_POOL_SHAPES = 8  # the dtypes and lengths kept, the latest used: inputs of varying shapes (sentences...) keep few
_host_pools: OrderedDict[tuple[torch.dtype, int], list[Tensor]] = OrderedDict()


class _HostCopy:
    """A CPU input's copy, with its layout, into a buffer reused from copy to copy.

    The Metric gets the view the caller passed: the same sizes, strides (a transposed or ``channels_last`` tensor,
    a slice, an ``expand``) and alignment in memory. An op over a view runs over its memory in another order than
    over a contiguous copy (a sum adds in another order), and one that needs a contiguous tensor (``.view``) fails
    on it, as on the plain Metric. What is copied is the memory the view spans, from its first element to its last
    (with the gaps between them: a column of a matrix spans the matrix's rows).

    A copy into memory just allocated touches its pages for the first time, in the caller's thread: about half a
    millisecond a megabyte where an update's inputs are large. The worker takes a copy of its own from the buffer,
    off the step, and hands the buffer back.
    """

    __slots__ = ("host", "offset", "pool", "shape", "stride")

    def __init__(self, tensor: Tensor) -> None:
        self.shape, self.stride = tensor.shape, tensor.stride()
        source = spanned(tensor)
        self.offset = misalignment(tensor)
        key = (tensor.dtype, self.offset + source.numel())
        if key in _host_pools:
            _host_pools.move_to_end(key)
        elif len(_host_pools) >= _POOL_SHAPES:
            _host_pools.popitem(last=False)
        self.pool = _host_pools.setdefault(key, [])
        if self.pool:
            self.host = self.pool.pop()
        else:
            with torch.inference_mode(False):  # made in an evaluation loop, it is reused outside one
                self.host = torch.empty(key[1], dtype=tensor.dtype)
        self.host[self.offset :].copy_(source)

    def wait(self) -> Tensor:
        return self.host

    def landed(self) -> Tensor:
        """The caller's view again, on memory of its own (a copy of the buffer), at the same alignment."""
        return self.host.clone().as_strided(self.shape, self.stride, self.offset)

    def release(self) -> None:
        if len(self.pool) < _POOL_SIZE:
            self.pool.append(self.host)


class _InFlight:
    """A tensor input's copy to the CPU, started at the call (on CUDA, without waiting for it)."""

    __slots__ = ("copy", "flags")

    def __init__(self, tensor: Tensor) -> None:
        tensor = tensor.detach()
        if type(tensor) is not Tensor and not _SUBCLASSES_UNDER_A_MODE:
            raise TypeError(
                f"offload_to_cpu's worker thread cannot take an input of the tensor subclass {type(tensor).__name__}"
                f" with torch {torch.__version__}: its ops fail there under the worker's dispatch mode (torch 2.4"
                " fixed it). HINT: offload with `worker='process'`, pass a plain tensor"
                " (`x.as_subclass(torch.Tensor)`), or upgrade torch to 2.4 or later."
            )
        self.flags = flags(tensor)
        tensor = unflagged(tensor)
        transfer = _transfer_for(tensor.device)
        self.copy: _Copy | _HostCopy
        if transfer is not None:
            self.copy = transfer.start(tensor, snapshot=True)  # the training stream never waits for the copy
        elif _small_and_whole(tensor) or type(tensor) is not Tensor:
            # a loss, a few predictions: a copy of its own has the very same layout; a subclass: it keeps its class
            self.copy = _Landed(tensor)
        elif tensor.is_cpu and tensor.layout == torch.strided and not tensor.is_quantized and tensor.numel():
            self.copy = _HostCopy(tensor)
        else:  # another device (MPS), or a tensor with no strided memory: a blocking copy of its own, as `.cpu()`
            self.copy = _Landed(tensor)

    def land(self) -> Tensor:
        """The CPU copy, a tensor of its own (the Metric may keep it); the buffer's memory is handed back.

        A CPU input lands with the caller's layout. One from a device lands with the layout ``tensor.cpu()`` gives
        (a dense view, transposed or ``channels_last``, keeps its strides; another is made contiguous). Either
        lands with the caller's flags (an inference tensor, a conjugate view: see ``_layout.as_passed``).
        """
        try:
            if isinstance(self.copy, _HostCopy):
                return as_passed(self.copy.landed, self.flags)
            host = self.copy.wait()
            if isinstance(self.copy, _Landed) and host.is_inference() == self.flags[0]:
                return as_passed(lambda: host, self.flags)  # a copy of its own already, made in the right mode
            return as_passed(host.clone, self.flags)
        finally:
            self.copy.release()


_FLAT = (Tensor, int, float, bool, str, type(None))  # what an update's arguments most often are: no collection


# At most this, an input is copied into memory just allocated (a worker process gets it with the message), no buffer
# kept for it. A larger allocation can cost the caller's thread much more than the copy: after a step of many small
# tensors, glibc's malloc first merges the small blocks they freed (about 30 µs), and after large temporaries were
# freed it may trim and grow its heap again (milliseconds, at times). A buffer kept is not allocated again.
_SMALL_BYTES = 512


def _whole_on_cpu(tensor: Tensor) -> bool:
    """Whether ``tensor`` is a dense CPU tensor that is contiguous and starts aligned as torch aligns."""
    return (
        tensor.is_cpu
        and tensor.layout == torch.strided
        and tensor.is_contiguous()
        and misalignment(tensor) == 0
        and not tensor.is_quantized
    )


def _small_and_whole(tensor: Tensor) -> bool:
    """Whether ``tensor`` is a small CPU tensor that starts its memory and is contiguous, aligned as torch aligns."""
    return _whole_on_cpu(tensor) and tensor.numel() * tensor.element_size() <= _SMALL_BYTES


def _map_inputs(inputs: tuple[tuple, dict], kind: type | tuple[type, ...], fn: Callable) -> tuple[tuple, dict]:
    """``(args, kwargs)`` with ``fn`` applied to each ``kind`` at any depth (lists, tuples, dicts...).

    The lists, tuples and dicts are new ones, as ``apply_to_collection`` makes (a list the caller changes after
    the call is not the update's). Arguments of tensors, numbers and strings, and plain lists, tuples and dicts
    of them (most updates': a text Metric's sentences), are walked here: ``apply_to_collection`` costs a few
    microseconds an element. Anything else (a dataclass, a named tuple) is left to it.
    """
    args, kwargs = inputs
    flat = (kind, *_FLAT) if isinstance(kind, type) else (*kind, *_FLAT)
    if all(_walked_here(a, flat) for a in args) and all(_walked_here(v, flat) for v in kwargs.values()):
        return tuple(_mapped(a, kind, fn) for a in args), {k: _mapped(v, kind, fn) for k, v in kwargs.items()}
    return apply_to_collection(inputs, kind, fn)


_ATOMS = frozenset({str, int, float, bool, type(None)})  # exact types: a list of only these is copied whole


def _walked_here(value: Any, flat: tuple[type, ...]) -> bool:
    """Whether ``value`` is a ``flat`` one, or a plain list, tuple or dict of such values at any depth."""
    if isinstance(value, flat):
        return True
    if type(value) is list or type(value) is tuple:
        return _ATOMS.issuperset(map(type, value)) or all(_walked_here(v, flat) for v in value)
    if type(value) is dict:
        return all(_walked_here(v, flat) for v in value.values())
    return False


def _mapped(value: Any, kind: type | tuple[type, ...], fn: Callable) -> Any:
    """``value`` (one :func:`_walked_here` accepts) with ``fn`` applied to each ``kind`` in it."""
    if isinstance(value, kind):
        return fn(value)
    if type(value) is list:
        return list(value) if _ATOMS.issuperset(map(type, value)) else [_mapped(v, kind, fn) for v in value]
    if type(value) is tuple:
        return value if _ATOMS.issuperset(map(type, value)) else tuple(_mapped(v, kind, fn) for v in value)
    if type(value) is dict:
        return {k: _mapped(v, kind, fn) for k, v in value.items()}
    return value


def _start_copies(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """``args`` and ``kwargs`` with each tensor, at any depth (lists, tuples, dicts...), replaced by its copy."""
    return _map_inputs((args, kwargs), Tensor, _InFlight)


def _land(started: tuple[tuple, dict]) -> tuple[tuple, dict]:
    """The inputs again, each copy landed on the CPU: in the worker, which waits for them."""
    return _map_inputs(started, _InFlight, _InFlight.land)


def _on_cpu_now(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The inputs with each tensor elsewhere copied to the CPU now (``forward``, which must return its value)."""
    return _map_inputs((args, kwargs), Tensor, _to_cpu)


def _to_cpu(tensor: Tensor) -> Tensor:
    return tensor if tensor.is_cpu else tensor.detach().to("cpu")
