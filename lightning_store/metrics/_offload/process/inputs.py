"""An update's inputs for the worker process: tensors written into the shared arena, read back there."""

import ctypes
import pickle
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from lightning_store._buffer import _Copy, _transfer_for
from lightning_store.metrics._offload.inputs import _SMALL_BYTES, _map_inputs, _small_and_whole, _whole_on_cpu
from lightning_store.metrics._offload.layout import Flags, as_passed, flags, misalignment, spanned, unflagged
from lightning_store.metrics._offload.process import pickling as _pickling
from lightning_store.metrics._offload.process.arena import _aligned, _Arena
from lightning_store.metrics._offload.process.pickling import _dense, _memory_of, _tensor


class _InArena:
    """Where a tensor input lies in the arena, and its layout: what the worker process needs to read it back."""

    __slots__ = ("arena", "count", "dtype", "flags", "offset", "pad", "shape", "stride")

    def __init__(self, dtype: torch.dtype, shape: tuple, stride: tuple, pad: int, count: int, passed: Flags) -> None:
        self.arena, self.offset = "", 0  # set when the arena's space is taken
        self.dtype, self.shape, self.stride, self.pad, self.count = dtype, shape, stride, pad, count
        self.flags = passed

    @property
    def nbytes(self) -> int:
        return _aligned(self.count * self.dtype.itemsize)

    def read(self, arenas: Callable[[str], _Arena]) -> Tensor:
        """The tensor, on memory of its own, with its layout and alignment (in the worker process)."""
        if not self.count:
            return as_passed(lambda: torch.empty_strided(self.shape, self.stride, dtype=self.dtype), self.flags)
        flat = arenas(self.arena).tensor(self.offset, self.dtype, self.count)
        return as_passed(lambda: flat.clone().as_strided(self.shape, self.stride, self.pad), self.flags)

    def __getstate__(self) -> tuple:
        return tuple(getattr(self, name) for name in self.__slots__)

    def __setstate__(self, state: tuple) -> None:
        for name, value in zip(self.__slots__, state, strict=True):
            setattr(self, name, value)


class _Small:
    """A small CPU tensor read at the call: its bytes and layout, which unpickle as a tensor of its own.

    Read straight from the tensor's memory (a contiguous tensor that starts aligned, read as it lies), which costs
    a fraction of a microsecond, where a copy and torch's pickling of it cost several: a loss or a few predictions
    per update. The tensor unpickled is aligned as the original, with its flags (see ``_layout.as_passed``).
    """

    __slots__ = ("data", "dtype", "flags", "shape", "stride")

    def __init__(self, tensor: Tensor, passed: Flags) -> None:
        self.data = _memory_of(tensor)
        self.dtype, self.shape, self.stride, self.flags = tensor.dtype, tuple(tensor.shape), tensor.stride(), passed

    def __reduce__(self) -> tuple[Any, ...]:
        return _unpickled, (self.data, self.dtype, self.shape, self.stride, self.flags)


def _unpickled(data: bytearray, dtype: torch.dtype, shape: tuple, stride: tuple, passed: Flags) -> Tensor:
    return as_passed(lambda: _tensor(data, dtype, shape, stride, passed[0]), passed)


class _Outgoing:
    """An update's inputs on their way into the arena: CPU tensors written at once, device ones when they land.

    A CPU input is read as it is at the call, with its layout (see ``_inputs._HostCopy``). A CUDA input is copied
    to pinned memory without a host sync (``_buffer._CUDATransfer``, with the layout ``tensor.cpu()`` gives), and
    written into the arena once the copy has landed, which :meth:`ready` tells without waiting.

    Most updates get tensors alone, each a whole CPU tensor (``preds, target``): those go as :class:`_Whole`, a
    tuple of plain values for each, which both processes pickle and read in a fraction of the general path's time.
    """

    def __init__(self, args: tuple, kwargs: dict) -> None:
        self.pending: list[tuple[_InArena, _Copy]] = []
        self.written: list[tuple[_InArena, Tensor]] = []
        self.tensors = False  # whether an input is sent as a tensor (sparse, quantized...): see `_pickling.dumps`
        self.whole = _Whole.of(args, kwargs)
        if self.whole is not None:
            self.nbytes = self.whole.nbytes
            return
        self.inputs = _map_inputs((args, kwargs), Tensor, self._describe)
        self.nbytes = sum(where.nbytes for where, _ in (*self.pending, *self.written))

    def _describe(self, tensor: Tensor) -> Any:
        tensor = tensor.detach()
        transfer = _transfer_for(tensor.device)
        if transfer is None:
            if type(tensor) is Tensor and _small_and_whole(tensor):
                return _Small(unflagged(tensor), flags(tensor))  # with the message: a loss, a few predictions
            if type(tensor) is not Tensor or tensor.layout != torch.strided or tensor.is_quantized:
                self.tensors = True  # a subclass (its class kept), a sparse or quantized tensor: pickled by torch
                return tensor.to("cpu", copy=True)
        passed, tensor = flags(tensor), unflagged(tensor)
        if transfer is not None:
            copy = transfer.start(tensor, snapshot=True)  # its host tensor has the layout `tensor.cpu()` gives
            shape, stride = tuple(tensor.shape), _dense_stride(tensor)
            where = _InArena(tensor.dtype, shape, stride, 0, tensor.numel(), passed)
            self.pending.append((where, copy))
            return where
        if not tensor.is_cpu:
            tensor = tensor.to("cpu")  # another device (MPS): a blocking copy
        source, pad = spanned(tensor), misalignment(tensor)
        count = pad + source.numel() if source.numel() else 0
        where = _InArena(tensor.dtype, tuple(tensor.shape), tensor.stride(), pad, count, passed)
        self.written.append((where, source))
        return where

    def pickled(self, name: str) -> bytes | list:
        """The inputs, pickled at the call (``name``: the Metric's); a ``TypeError`` if one cannot be.

        Whole CPU tensors alone go as plain values, which the update's message pickles (see :class:`_Whole`).
        """
        if self.whole is not None:
            return self.whole.described
        try:
            if self.tensors:
                return _pickling.dumps(self.inputs)
            # most often no tensor is left in them (they are in the arena, or `_Small`): pickle's own is faster
            return pickle.dumps(self.inputs, pickle.HIGHEST_PROTOCOL)
        except Exception as error:
            raise TypeError(
                f"{name}.update got an input that cannot be pickled ({error}), and the worker process takes a copy"
                " of each: the update is not queued, and the Metric's state is as before the call. HINT: pass"
                " tensors, numbers, strings, and lists, tuples or dicts of them (not a generator, a lambda or an"
                " open file), or pass worker='thread' to offload_to_cpu."
            ) from error

    def place(self, arena: _Arena, offset: int) -> None:
        """Write the CPU inputs at ``offset`` in ``arena`` (taken for :attr:`nbytes`), and place the others after."""
        if self.whole is not None:
            self.whole.place(arena, offset)
            return
        for where, _ in (*self.written, *self.pending):
            where.arena, where.offset = arena.name, offset
            offset += where.nbytes
        for where, source in self.written:
            if where.count:
                arena.tensor(where.offset, where.dtype, where.count)[where.pad :].copy_(source)
        self.written = []  # the caller's tensors are not kept

    def ready(self) -> bool:
        """Whether every device input has landed on the host (without waiting)."""
        return all(copy.ready() for _, copy in self.pending)

    def release(self) -> None:
        """Hand back the pinned memory of the device inputs not written (the update is not sent)."""
        for _, copy in self.pending:
            copy.release()
        self.pending = []

    def land(self, arena: _Arena) -> None:
        """Write the device inputs into ``arena``, waiting for their copies, and hand their pinned memory back."""
        for where, copy in self.pending:
            try:
                host = copy.wait()
                flat = host.as_strided((host.numel(),), (1,), host.storage_offset())
                arena.tensor(where.offset, where.dtype, where.count).copy_(flat)
            finally:
                copy.release()
        self.pending = []


_DTYPES = {
    dtype: name for name, dtype in vars(torch).items() if isinstance(dtype, torch.dtype) and not name.startswith("_")
}
_BY_NAME = {name: dtype for dtype, name in _DTYPES.items()}


class _Whole:
    """An update's inputs when they are CPU tensors alone, each whole: contiguous, aligned, with no lazy flag.

    Each goes as a tuple of plain values: a small one with its bytes (``(bytes, dtype, shape, stride,
    inference)``), a larger one as where it lies in the arena (``(arena, offset, nbytes, dtype, shape, stride,
    inference)``);
    ``described`` is ``[those, kwargs' names]`` (a list: the worker process tells it from pickled inputs by that).
    Read back by :func:`_read_whole`, with the layout, the alignment and the inference flag of the input, as the
    general path's.
    """

    __slots__ = ("described", "large", "nbytes")

    @classmethod
    def of(cls, args: tuple, kwargs: dict) -> "_Whole | None":
        """The inputs as ``_Whole``, or ``None`` where one is not such a tensor (they take the general path)."""
        tensors = (*args, *kwargs.values())
        if not all(type(t) is Tensor and _whole(t) for t in tensors):
            return None
        return cls(tensors, tuple(kwargs))

    def __init__(self, tensors: tuple[Tensor, ...], names: tuple[str, ...]) -> None:
        self.large: list[tuple[int, Tensor, int]] = []  # (index, tensor, bytes) of those written into the arena
        described: list[Any] = []
        for index, tensor in enumerate(tensors):
            nbytes = tensor.numel() * tensor.element_size()
            if nbytes <= _SMALL_BYTES:
                data = ctypes.string_at(tensor.data_ptr(), nbytes)  # bytes: copied from as they are, in one move
                shape, stride = tuple(tensor.shape), tensor.stride()
                described.append((data, _DTYPES[tensor.dtype], shape, stride, tensor.is_inference()))
            else:
                self.large.append((index, tensor, nbytes))
                described.append(None)
        self.described: list = [described, names]
        self.nbytes = sum(_aligned(nbytes) for _, _, nbytes in self.large)

    def place(self, arena: _Arena, offset: int) -> None:
        """Write the larger tensors at ``offset`` in ``arena``, taken for :attr:`nbytes`."""
        described = self.described[0]
        for index, tensor, nbytes in self.large:
            ctypes.memmove(arena.address + offset, tensor.data_ptr(), nbytes)  # contiguous: its bytes, in one move
            shape, stride = tuple(tensor.shape), tensor.stride()
            described[index] = (arena.name, offset, nbytes, _DTYPES[tensor.dtype], shape, stride, tensor.is_inference())
            offset += _aligned(nbytes)
        self.large = []  # the caller's tensors are not kept


def _whole(tensor: Tensor) -> bool:
    """Whether ``tensor`` is a non-empty dense CPU tensor that starts aligned and is contiguous, with no lazy flag."""
    return (
        _whole_on_cpu(tensor)
        and _transfer_for(tensor.device) is None  # read as it lies now, not copied off a device first
        and tensor.numel() > 0
        and not tensor.is_conj()
        and not tensor.is_neg()
        and tensor.dtype in _DTYPES
    )


def _read_whole(described: list, arenas: Callable[[str], _Arena]) -> tuple[tuple, dict]:
    """The inputs :class:`_Whole` described, each a tensor on memory of its own (in the worker process)."""
    tensors, names = described
    made = [_made(one, arenas) for one in tensors]
    if not names:
        return tuple(made), {}
    split = len(made) - len(names)
    return tuple(made[:split]), dict(zip(names, made[split:], strict=True))


def _made(one: tuple, arenas: Callable[[str], _Arena]) -> Tensor:
    # contiguous, so its span is its bytes, as the parent counted them
    if len(one) == 5:  # small: its bytes
        data, dtype, shape, stride, inference = one
        return _dense(data, len(data), _BY_NAME[dtype], shape, stride, inference)
    name, offset, nbytes, dtype, shape, stride, inference = one
    return _dense(arenas(name).address + offset, nbytes, _BY_NAME[dtype], shape, stride, inference)


def _dense_stride(tensor: Tensor) -> tuple[int, ...]:
    """The strides ``tensor.cpu()`` gives: its own where it is dense, else those of a contiguous tensor."""
    return tuple(torch.empty_like(tensor, device="meta").stride())


def _read_inputs(inputs: tuple[tuple, dict], arenas: Callable[[str], _Arena]) -> tuple[tuple, dict]:
    """The inputs again, each tensor read from the arena (in the worker process)."""
    return _map_inputs(inputs, _InArena, lambda where: where.read(arenas))
