"""Pickling for the worker process: an object with its states, each CPU tensor as its bytes (fast for many small)."""

import ctypes
import io
import pickle
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


def _tensor(data: bytearray, dtype: torch.dtype, shape: tuple, stride: tuple, inference: bool) -> Tensor:
    """A tensor pickled by :class:`_Pickler`, on memory torch allocated (aligned as the original was).

    Made in inference mode if it was an inference tensor, else out of it; the mode is entered only if it is not the
    one in force (entering it costs more than making a small tensor, and a read may make thousands).
    """
    if torch.is_inference_mode_enabled() != inference:
        with torch.inference_mode(inference):
            return _tensor(data, dtype, shape, stride, inference)
    if not data:
        return torch.empty_strided(shape, stride, dtype=dtype)
    return torch.frombuffer(data, dtype=torch.uint8).clone().view(dtype).as_strided(shape, stride, 0)


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


def dumps(obj: Any) -> bytes:
    buffer = io.BytesIO()
    _Pickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    return buffer.getvalue()
