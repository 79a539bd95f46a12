"""Pickling for the worker process: an object with its states, each CPU tensor as its bytes (fast for many small)."""

import ctypes
import io
import math
import pickle
import sys
from collections.abc import Callable, Hashable, Mapping
from typing import Any

import torch
from torch import Tensor

from lightning_store.metrics._offload.layout import spanned


class _Pickler(pickle.Pickler):
    """A pickler that writes a plain CPU tensor as its dtype, layout and bytes.

    torch pickles a tensor's storage through ``torch.save``, some tens of microseconds each: a list state of
    thousands of elements took most of a read. Sharing is kept where pickle keeps it (one object, pickled once);
    a tensor comes back on memory of its own, as an inference tensor if it was one.
    """

    def reducer_override(self, obj: Any) -> Any:
        if type(obj) is not Tensor or not _plain(obj):
            return NotImplemented
        if obj.is_contiguous():  # most often (an empty tensor is): its elements lie as they are read
            data = _memory_of(obj)
        else:
            data = bytearray(spanned(obj).contiguous().view(torch.uint8).numpy().tobytes())
        return _tensor, (data, obj.dtype, tuple(obj.shape), obj.stride(), obj.is_inference())


class _Referencing(_Pickler):
    """A :class:`_Pickler` that writes the tensors of ``known`` (by ``id``) as the reference it gives each."""

    def __init__(self, file: io.BytesIO, known: Mapping[int, Hashable]) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.known = known

    def persistent_id(self, obj: Any) -> Hashable | None:
        return self.known.get(id(obj)) if type(obj) is Tensor else None


class _Resolving(pickle.Unpickler):
    """An unpickler that makes the object a reference stands for with ``resolve``, once for each reference."""

    def __init__(self, file: io.BytesIO, resolve: Callable[[Any], Any]) -> None:
        super().__init__(file)
        self.resolve = resolve
        self.made: dict[Hashable, Any] = {}

    def persistent_load(self, pid: Any) -> Any:
        if pid not in self.made:  # pickle memoizes no reference: the same tensor twice is one tensor again
            self.made[pid] = self.resolve(pid)
        return self.made[pid]


_STACKED_FROM = 64  # elements: a shorter list state goes tensor by tensor


class _Stacked:
    """A list of plain CPU tensors of one dtype and shape, pickled as one block of their bytes (see :func:`stacked`).

    Unpickled, it is a list again, of tensors each on memory of its own (:func:`_unstacked`).
    """

    __slots__ = ("tensors",)

    def __init__(self, tensors: list[Tensor]) -> None:
        self.tensors = tensors

    def __reduce__(self) -> tuple[Any, ...]:
        first = self.tensors[0]
        block = _memory_of(torch.stack(self.tensors))  # one op, where each tensor's bytes take a reduction of its own
        return _unstacked, (block, first.dtype, tuple(first.shape), first.is_inference(), len(self.tensors))


def stacked(value: Any) -> Any:
    """``value`` as a :class:`_Stacked` if it is a long list of plain CPU tensors pickled alike, else as it is.

    A list state of scalars appended at each update (ROUGE's: one per sentence and score) has thousands: pickled
    tensor by tensor, a read of 10,800 took 70 ms, 25 in one block. The list qualifies only if each tensor is in
    it once and nowhere else (it is then unpickled as a tensor of its own, as pickle would), contiguous, and of
    the first one's dtype, shape and inference flag.
    """
    if type(value) is not list or len(value) < _STACKED_FROM or type(value[0]) is not Tensor:
        return value
    alike = (value[0].dtype, value[0].shape, value[0].is_inference())
    for tensor in value:
        # referenced by the list, this loop and the call alone: shared with nothing pickle would keep it shared with
        if sys.getrefcount(tensor) != 3 or type(tensor) is not Tensor or not _plain(tensor):
            return value
        if (tensor.dtype, tensor.shape, tensor.is_inference()) != alike or not tensor.is_contiguous():
            return value
    return _Stacked(value)


def _unstacked(block: bytearray, dtype: torch.dtype, shape: tuple, inference: bool, count: int) -> list[Tensor]:
    """The list :class:`_Stacked` pickled: each tensor a copy of its part of ``block``, on memory of its own.

    Made in inference mode if they were inference tensors, else out of it, as :func:`_tensor` makes one.
    """
    if torch.is_inference_mode_enabled() != inference:
        with torch.inference_mode(inference):
            return _unstacked(block, dtype, shape, inference, count)
    flat = _tensor(block, dtype, (count * math.prod(shape),), (1,), inference)
    return [part.clone() for part in flat.view(count, *shape).unbind(0)]


def _plain(tensor: Tensor) -> bool:
    return (
        tensor.device.type == "cpu"
        and tensor.layout == torch.strided
        and not tensor.requires_grad
        and not tensor.is_quantized
        and not tensor.is_conj()
        and not tensor.is_neg()
    )


def _memory_of(tensor: Tensor) -> bytearray:
    """The bytes of a contiguous CPU ``tensor``, read as they lie in its memory (1 µs, where a copy takes ten)."""
    size = tensor.numel() * tensor.element_size()
    return bytearray((ctypes.c_char * size).from_address(tensor.data_ptr())) if size else bytearray()


def _tensor(data: bytes | bytearray, dtype: torch.dtype, shape: tuple, stride: tuple, inference: bool) -> Tensor:
    """A tensor pickled by :class:`_Pickler`, made by :func:`_dense` (aligned as the original was).

    Made in inference mode if it was an inference tensor, else out of it; the mode is entered only if it is not the
    one in force (entering it costs more than making a small tensor, and a read may make thousands).
    """
    if data and len(data) != _span(shape, stride) * dtype.itemsize:  # never seen: the bytes read as they were sent
        with torch.inference_mode(inference):
            return torch.frombuffer(data, dtype=torch.uint8).clone().view(dtype).as_strided(shape, stride, 0)
    source = data if isinstance(data, bytes) else (ctypes.c_char * len(data)).from_buffer(data)
    return _dense(source, len(data), dtype, shape, stride, inference)


def _span(shape: tuple, stride: tuple) -> int:
    """The elements a layout spans in its storage, as ``torch.empty_strided`` allocates them."""
    if 0 in shape:
        return 0
    return 1 + sum((size - 1) * step for size, step in zip(shape, stride, strict=True))


def _dense(
    source: int | bytes | ctypes.Array, nbytes: int, dtype: torch.dtype, shape: tuple, stride: tuple, inference: bool
) -> Tensor:
    """A tensor of ``shape`` and ``stride``, its ``nbytes`` (its whole span) copied from ``source`` in one move.

    ``source``: an address, or bytes. One op, where a view of the memory and its clone, or a tensor of the bytes,
    cost three or four. Made in inference mode if ``inference``, else out of it.
    """
    if torch.is_inference_mode_enabled() != inference:
        with torch.inference_mode(inference):
            return _dense(source, nbytes, dtype, shape, stride, inference)
    tensor = torch.empty_strided(shape, stride, dtype=dtype)
    if nbytes:
        ctypes.memmove(tensor.data_ptr(), source, nbytes)
    return tensor


def _exception(cls: type[BaseException], args: tuple, state: dict[str, Any]) -> BaseException:
    """The exception ``_ExceptionParts`` pickled: its class, ``args`` and attributes, without its constructor."""
    error = cls.__new__(cls, *args)
    error.args = args
    error.__dict__.update(state)
    return error


class _ExceptionParts:
    """An exception whose constructor takes other arguments than its ``args``, pickled as its parts."""

    def __init__(self, error: BaseException) -> None:
        self.parts = (type(error), error.args, dict(vars(error)))

    def __reduce__(self) -> tuple[Any, ...]:
        return _exception, self.parts


def pickles(obj: Any) -> bool:
    """Whether ``obj`` pickles (a class of ``__main__`` may not, in the worker process)."""
    try:
        pickle.dumps(obj)
    except Exception:
        return False
    return True


def dumps(obj: Any, known: Mapping[int, Hashable] | None = None) -> bytes:
    """``obj`` pickled by :class:`_Pickler`; the tensors of ``known`` (by ``id``) as the references it gives them."""
    buffer = io.BytesIO()
    pickler = _Referencing(buffer, known) if known else _Pickler(buffer, protocol=pickle.HIGHEST_PROTOCOL)
    pickler.dump(obj)
    return buffer.getvalue()


def loads(payload: bytes, resolve: Callable[[Any], Any]) -> Any:
    """What :func:`dumps` pickled, each reference made by ``resolve``."""
    return _Resolving(io.BytesIO(payload), resolve).load()
