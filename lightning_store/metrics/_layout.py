"""A tensor's memory as a view reads it: the span from its first element to its last, and its alignment."""

from torch import Tensor

ALIGNMENT = 64  # bytes: torch's CPU allocator aligns the memory of every tensor to it


def spanned(tensor: Tensor) -> Tensor:
    """The memory ``tensor`` reads, gaps included, as a 1-D tensor on it (empty for an empty ``tensor``)."""
    if not tensor.numel():
        return tensor.reshape(0)
    span = 1 + sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride(), strict=True))
    return tensor.as_strided((span,), (1,), tensor.storage_offset())


def misalignment(tensor: Tensor) -> int:
    """How many elements ``tensor``'s data starts after an aligned address (0 for a tensor torch allocated)."""
    return tensor.data_ptr() % ALIGNMENT // tensor.element_size()
