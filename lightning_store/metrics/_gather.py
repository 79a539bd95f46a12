"""All-gather on the collective's device, in chunks of bounded size, for tensors of uneven sizes across ranks."""

import functools
import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from lightning_store._checks import _check_positive_int

DEFAULT_CHUNK_BYTES = 64 * 2**20

# the dtypes a state can have, numbered for the shape exchange (the same torch on every process)
_DTYPES = tuple(
    getattr(torch, name)
    for name in (
        "bool",
        "uint8",
        "int8",
        "int16",
        "int32",
        "int64",
        "float16",
        "bfloat16",
        "float32",
        "float64",
        "complex64",
        "complex128",
        "complex32",
        "uint16",
        "uint32",
        "uint64",
        "float8_e4m3fn",
        "float8_e5m2",
    )
    if hasattr(torch, name)
)
_DTYPE_INDEX = {dtype: index for index, dtype in enumerate(_DTYPES)}
_MAX_DIMS = 8
_NO_DATA = -1  # in place of `ndim`: the rank holds no element


def _is_gather_on_device(fn: Any) -> bool:
    """Whether ``fn`` is :func:`gather_on_device`, or a ``functools.partial`` of it (with ``chunk_bytes``)."""
    return fn is gather_on_device or (isinstance(fn, functools.partial) and fn.func is gather_on_device)


def _check_chunk_bytes(chunk_bytes: Any) -> None:
    """Raise an error that says how to fix ``chunk_bytes`` unless it is a positive ``int``."""
    hint = f"pass a number of bytes, such as chunk_bytes={DEFAULT_CHUNK_BYTES} (the default)."
    _check_positive_int(chunk_bytes, "chunk_bytes", hint)


def _collective_device(tensor: Tensor, group: Any) -> torch.device:
    """Where the collective can run: the current CUDA device under NCCL, else where ``tensor`` is."""
    if torch.distributed.get_backend(group) == torch.distributed.Backend.NCCL:
        return torch.device("cuda", torch.cuda.current_device())
    return tensor.device


def _layout(tensor: Tensor) -> list[int]:
    """``[ndim, dtype, *shape]``, the shape padded with zeros to ``_MAX_DIMS``."""
    if tensor.dtype not in _DTYPE_INDEX:
        raise TypeError(
            f"gather_on_device cannot gather tensors of dtype {tensor.dtype}."
            f" HINT: keep the state in one of {', '.join(str(d) for d in _DTYPES)}."
        )
    if tensor.ndim > _MAX_DIMS:
        raise ValueError(
            f"gather_on_device gathers tensors of at most {_MAX_DIMS} dimensions, got {tensor.ndim}."
            " HINT: keep the state flatter, with `.reshape(...)` in `update` and back in `compute`."
        )
    return [tensor.ndim, _DTYPE_INDEX[tensor.dtype], *tensor.shape, *[0] * (_MAX_DIMS - tensor.ndim)]


def _describe(tensor: Tensor, device: torch.device) -> Tensor:
    """The layout of ``tensor``, with ``ndim`` ``-1`` for a rank with no element."""
    layout = _layout(tensor)
    if tensor.numel() == 0:
        layout[0] = _NO_DATA
    return torch.tensor(layout, dtype=torch.int64, device=device)


def _gather(tensor: Tensor, group: Any, chunk_bytes: int) -> list[Tensor]:
    world_size = torch.distributed.get_world_size(group)
    device = _collective_device(tensor, group)
    local = _describe(tensor, device)
    described = [torch.empty_like(local) for _ in range(world_size)]
    torch.distributed.all_gather(described, local, group=group)
    layouts = [(int(d[0]), _DTYPES[int(d[1])], tuple(int(s) for s in d[2:])) for d in described]
    with_data = [(ndim, dtype, shape[:ndim]) for ndim, dtype, shape in layouts if ndim != _NO_DATA]
    if not with_data:  # no rank holds anything: each keeps the shape of its own empty tensor
        return [
            torch.empty(shape[: len(tensor.shape)], dtype=tensor.dtype, device=tensor.device) for *_, shape in layouts
        ]
    ndim, dtype, first = with_data[0]
    scalar = ndim == 0
    trailing = () if scalar else first[1:]
    for other_ndim, other_dtype, other in with_data:
        if other_ndim != ndim or other_dtype != dtype or (not scalar and other[1:] != trailing):
            raise ValueError(
                "gather_on_device needs the same dtype and the same size in every dimension but the first on every"
                f" rank, got {dtype} {first} and {other_dtype} {other}."
            )
    rows = [0 if layout[0] == _NO_DATA else (1 if scalar else layout[2][0]) for layout in layouts]
    out = [torch.empty((n, *trailing), dtype=dtype, device=tensor.device) for n in rows]
    me = torch.distributed.get_rank(group)
    local_rows = tensor.reshape(-1, *trailing).to(dtype) if rows[me] else None
    row_bytes = max(1, math.prod(trailing) * torch.empty((), dtype=dtype).element_size())
    # the send chunk and the gathered chunks of every rank must fit in `chunk_bytes`: at least one row
    step = max(1, min(max(rows), chunk_bytes // ((world_size + 1) * row_bytes)))
    send = torch.empty((step, *trailing), dtype=dtype, device=device)
    received = [torch.empty_like(send) for _ in range(world_size)]
    for start in range(0, max(rows), step):
        count = max(0, min(step, rows[me] - start))
        if local_rows is not None and count:
            send[:count].copy_(local_rows[start : start + count])
        torch.distributed.all_gather(received, send, group=group)
        for rank, chunk in enumerate(received):
            landed = max(0, min(step, rows[rank] - start))
            out[rank][start : start + landed].copy_(chunk[:landed])
    return [o.reshape(()) if scalar and o.shape[0] == 1 else o for o in out]


def gather_on_device(
    result: Tensor, group: Any | None = None, *, chunk_bytes: int = DEFAULT_CHUNK_BYTES
) -> list[Tensor]:
    """Gather ``result`` from every process, running the collective on its device: a ``dist_sync_fn`` for Metrics.

    Under NCCL the tensors are copied to ``torch.cuda.current_device()`` for the collective (NCCL refuses CPU
    tensors) and the gathered tensors come back to the device of ``result``; under gloo they stay where they are.
    Sizes may differ across processes in the first dimension, and a process may hold no element (an empty tensor:
    it takes the dtype and trailing size of the others). The gather runs in chunks: the device memory it needs, for
    the chunk sent and the chunks received from every process, is at most ``chunk_bytes`` (and at least one row).

    Args:
        result: the local tensor.
        group: the process group; ``None`` for the whole world.
        chunk_bytes: the most device memory a chunk of the gather takes.

    Returns:
        One tensor per process of ``group``, in the order of their ranks, on the device of ``result``.

    Raises:
        TypeError: if ``chunk_bytes`` is not an int.
        ValueError: if ``chunk_bytes`` is not positive, or if the processes' tensors differ in dtype or in any
            dimension but the first.

    Example:
        >>> from torchmetrics.classification import BinaryAUROC
        >>> metric = BinaryAUROC(
        ...     thresholds=None, compute_on_cpu=True, dist_sync_fn=gather_on_device
        ... )

    """
    _check_chunk_bytes(chunk_bytes)
    if group is None:
        group = torch.distributed.group.WORLD
    with torch.no_grad():
        return _gather(result.detach().contiguous(), group, chunk_bytes)


def _gather_elements(elements: Sequence[Tensor], group: Any, chunk_bytes: int) -> list[list[Tensor]]:
    """Every process's ``elements``, one list per rank, gathered in a bounded number of collectives.

    The elements may differ in shape and dtype, and processes in their number of elements (none, too). Their
    layouts are gathered in one :func:`_gather`, their bytes in another, each in chunks of at most ``chunk_bytes``;
    each process's bytes are then split back into its elements, in order. This process's elements are returned as
    they are; those of the others are tensors of their own on the device of ``elements`` (all on one device).
    """
    device = elements[0].device if elements else torch.device("cpu")
    layouts = torch.tensor([_layout(e) for e in elements], dtype=torch.int64, device=device)
    data = [e.detach().contiguous().reshape(-1).view(torch.uint8) for e in elements]
    empty = torch.empty(0, dtype=torch.uint8, device=device)
    with torch.no_grad():
        all_layouts = _gather(layouts.reshape(-1, 2 + _MAX_DIMS), group, chunk_bytes)
        all_data = _gather(torch.cat(data) if data else empty, group, chunk_bytes)
    me = torch.distributed.get_rank(group)
    out = []
    for rank, (rank_layouts, rank_data) in enumerate(zip(all_layouts, all_data, strict=True)):
        if rank == me:
            out.append(list(elements))
            continue
        kinds = [(_DTYPES[dtype], tuple(shape[:ndim])) for ndim, dtype, *shape in rank_layouts.tolist()]
        pieces = torch.split(rank_data.reshape(-1), [math.prod(shape) * dtype.itemsize for dtype, shape in kinds])
        # a piece of its own starts aligned, so its bytes can be viewed as its dtype
        out.append(
            [piece.clone().view(dtype).reshape(shape) for piece, (dtype, shape) in zip(pieces, kinds, strict=True)]
        )
    return out
