"""A tensor's memory as a view reads it: the span from its first element to its last, its alignment, its flags."""

from collections.abc import Callable

import torch
from torch import Tensor

ALIGNMENT = 64  # bytes: torch's CPU allocator aligns the memory of every tensor to it

# what a tensor carries besides its memory and layout: whether it is an inference tensor, and whether it is a lazy
# view that conjugates or negates its memory as it reads it (`x.conj()`, `x.conj().imag`)
Flags = tuple[bool, bool, bool]


def spanned(tensor: Tensor) -> Tensor:
    """The memory ``tensor`` reads, gaps included, as a 1-D tensor on it (empty for an empty ``tensor``)."""
    if not tensor.numel():
        return tensor.reshape(0)
    span = 1 + sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride(), strict=True))
    return tensor.as_strided((span,), (1,), tensor.storage_offset())


def misalignment(tensor: Tensor) -> int:
    """How many elements ``tensor``'s data starts after an aligned address (0 for a tensor torch allocated)."""
    return tensor.data_ptr() % ALIGNMENT // tensor.element_size()


def flags(tensor: Tensor) -> Flags:
    """The flags an input reaches the Metric with: a CPU tensor's own; for another, those ``tensor.cpu()`` gives."""
    if tensor.is_cpu:
        return tensor.is_inference(), tensor.is_conj(), tensor.is_neg()
    return torch.is_inference_mode_enabled(), False, False  # a copy made now, its values conjugated or negated


def unflagged(tensor: Tensor) -> Tensor:
    """A CPU ``tensor``'s memory read as it lies, without its conjugate and negative bits (a copy keeps them)."""
    if not tensor.is_cpu:
        return tensor  # its copy to the CPU resolves them, as `tensor.cpu()` does
    if tensor.is_conj():
        tensor = tensor.conj()
    if tensor.is_neg():
        tensor = torch._neg_view(tensor)
    return tensor


def as_passed(copy: Callable[[], Tensor], passed: Flags) -> Tensor:
    """A copy of an input (``copy()``, of its memory as it lies), made with the flags the input had (``passed``).

    An inference tensor used outside inference mode refuses an in-place update, and a normal tensor made in it
    does not: the copy is one when the input was one, whatever mode the update runs in.
    """
    inference, conj, neg = passed
    if torch.is_inference_mode_enabled() == inference:
        tensor = copy()
    else:
        with torch.inference_mode(inference):
            tensor = copy()
    if neg:
        tensor = torch._neg_view(tensor)
    return tensor.conj() if conj else tensor
