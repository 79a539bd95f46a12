"""An update's inputs, taken as they are at the call: copied to the CPU through the buffer's transfer, landed later."""

from collections import OrderedDict

import torch
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor

from lightning_store._buffer import _Copy, _Landed, _transfer_for

_POOL_SIZE = 16  # CPU buffers kept per dtype and shape
_POOL_SHAPES = 8  # the dtypes and shapes kept, the latest used: inputs of varying shapes (sentences...) keep few
_host_pools: OrderedDict[tuple[torch.dtype, torch.Size], list[Tensor]] = OrderedDict()


class _HostCopy:
    """A CPU input's copy into a buffer reused from copy to copy.

    A copy into memory just allocated touches its pages for the first time, in the caller's thread: about half a
    millisecond a megabyte where an update's inputs are large. The worker takes a copy of its own from the buffer,
    off the step, and hands the buffer back.
    """

    __slots__ = ("host", "pool")

    def __init__(self, tensor: Tensor) -> None:
        key = (tensor.dtype, tensor.shape)
        if key in _host_pools:
            _host_pools.move_to_end(key)
        elif len(_host_pools) >= _POOL_SHAPES:
            _host_pools.popitem(last=False)
        self.pool = _host_pools.setdefault(key, [])
        if self.pool:
            self.host = self.pool.pop()
        else:
            with torch.inference_mode(False):  # made in an evaluation loop, it is reused outside one
                self.host = torch.empty(tensor.shape, dtype=tensor.dtype)
        self.host.copy_(tensor)

    def wait(self) -> Tensor:
        return self.host

    def release(self) -> None:
        if len(self.pool) < _POOL_SIZE:
            self.pool.append(self.host)


class _InFlight:
    """A tensor input's copy to the CPU, started at the call (on CUDA, without waiting for it)."""

    __slots__ = ("copy",)

    def __init__(self, tensor: Tensor) -> None:
        tensor = tensor.detach()
        transfer = _transfer_for(tensor.device)
        self.copy: _Copy | _HostCopy
        if transfer is not None:
            self.copy = transfer.start(tensor, snapshot=True)  # the training stream never waits for the copy
        elif tensor.is_cpu:
            self.copy = _HostCopy(tensor)
        else:
            self.copy = _Landed(tensor)  # another device (MPS): a blocking copy of its own

    def land(self) -> Tensor:
        """The CPU copy, a tensor of its own (the Metric may keep it); the buffer's memory is handed back."""
        try:
            host = self.copy.wait()
            return host if isinstance(self.copy, _Landed) else host.clone()
        finally:
            self.copy.release()


def _start_copies(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """``args`` and ``kwargs`` with each tensor, at any depth (lists, tuples, dicts...), replaced by its copy."""
    return apply_to_collection((args, kwargs), Tensor, _InFlight)


def _land(started: tuple[tuple, dict]) -> tuple[tuple, dict]:
    """The inputs again, each copy landed on the CPU: in the worker, which waits for them."""
    return apply_to_collection(started, _InFlight, _InFlight.land)


def _on_cpu_now(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The inputs with each tensor elsewhere copied to the CPU now (``forward``, which must return its value)."""
    return apply_to_collection((args, kwargs), Tensor, _to_cpu)


def _to_cpu(tensor: Tensor) -> Tensor:
    return tensor if tensor.is_cpu else tensor.detach().to("cpu")


def _cloned_on_cpu(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The inputs with each tensor copied to the CPU now, a copy of its own (a trial update may change it)."""
    return apply_to_collection((args, kwargs), Tensor, lambda tensor: tensor.detach().to("cpu", copy=True))
