"""The CPU buffer: device-to-host copies that never stall the step, folded into the state in order."""

from collections import OrderedDict, deque
from collections.abc import Callable
from functools import cache
from typing import Protocol

import torch
from torch import Tensor

_Fold = Callable[[Tensor], None]


class _Copy(Protocol):
    """One device-to-host copy, possibly still in flight."""

    def ready(self) -> bool:
        """Whether the copy has landed, without waiting."""

    def wait(self) -> Tensor:
        """Block until the copy has landed and return the host tensor (valid until :meth:`release`)."""

    def release(self) -> None:
        """Hand the host memory back for reuse; the tensor from :meth:`wait` must not be used after this."""


class _Transfer(Protocol):
    """Starts device-to-host copies."""

    def start(self, tensor: Tensor, snapshot: bool = False) -> _Copy:
        """Start copying ``tensor`` to the CPU (``snapshot``: of a device copy of it, see :class:`_CUDATransfer`)."""


class _Landed:
    """A copy that is already on the CPU: a value from another device than the transfer's, copied at once.

    The copy is its own for a CPU value too: folded after the copies in flight before it, it must not see a change
    of the value in place meanwhile.
    """

    __slots__ = ("_tensor",)

    def __init__(self, tensor: Tensor) -> None:
        self._tensor = tensor.to("cpu", copy=True)

    def ready(self) -> bool:
        return True

    def wait(self) -> Tensor:
        return self._tensor

    def release(self) -> None:
        pass


class _Slot:
    """A pinned host tensor and the event that marks its copy as landed, reused from copy to copy."""

    __slots__ = ("event", "host", "pool")

    def __init__(self, host: Tensor, pool: "list[_Slot]") -> None:
        self.host = host
        self.event = torch.cuda.Event()
        self.pool = pool

    def ready(self) -> bool:
        return bool(self.event.query())

    def wait(self) -> Tensor:
        self.event.synchronize()
        return self.host

    def release(self) -> None:
        if len(self.pool) < _CUDATransfer.pool_size:
            self.pool.append(self)


class _CUDATransfer:
    """Non-blocking copies into a small pool of pinned memory, on a side stream of the value's device.

    The copy stream first waits for the stream that produced the value (the current stream), so the copy reads a
    finished value; that stream then waits for the copy, so its later kernels (an in-place change of the value, say)
    run after the copy has read it: the copy holds the value as it was at :meth:`start`, as Lightning's own
    ``self.log`` and torchmetrics' ``compute_on_cpu`` keep it. Both waits are on the device, never on the host, and
    the copy never waits for the NCCL streams. The landing event is recorded on the value's own device.
    """

    pool_size = 64
    pool_shapes = 16  # the dtypes and shapes whose memory is kept, the latest used (a Metric's inputs may vary)

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._stream = torch.cuda.Stream(device)
        self._pools: OrderedDict[tuple[torch.dtype, torch.Size, tuple[int, ...] | None], list[_Slot]] = OrderedDict()

    def start(self, tensor: Tensor, snapshot: bool = False) -> _Copy:
        """Start copying ``tensor`` to the CPU, holding it as it is now.

        With ``snapshot``, the producing stream first copies the value on the device (a device-to-device copy, at
        the device's memory bandwidth) and goes on at once; the copy to the CPU reads that snapshot, which is freed
        once the copy has landed. For large values (a Metric's inputs): the producing stream never waits for the
        copy to the CPU, at the cost of device memory for the values in flight.
        """
        if tensor.device != self.device:
            return _Landed(tensor)
        producer = torch.cuda.current_stream(self.device)
        with torch.cuda.device(self.device):
            # the snapshot, on the producing stream after the work it did, has the layout `tensor.cpu()` would give
            # (a dense view keeps its strides), and so has its host copy
            source = tensor.clone() if snapshot else tensor
            stride = source.stride() if snapshot else None
            slot = self._slot(tensor.dtype, tensor.shape, stride)
            self._stream.wait_stream(producer)
            with torch.cuda.stream(self._stream):
                slot.host.copy_(source, non_blocking=True)
                slot.event.record(self._stream)
            if not snapshot:
                producer.wait_event(slot.event)
        # kept: the allocator reuses the memory on the stream that allocated it, not always the one made to wait
        source.record_stream(self._stream)
        return slot

    def _slot(self, dtype: torch.dtype, shape: torch.Size, stride: tuple[int, ...] | None) -> _Slot:
        """A pinned host tensor of this dtype, shape and stride (contiguous if ``None``), reused if one is free."""
        key = (dtype, shape, stride)
        if key in self._pools:
            self._pools.move_to_end(key)
        elif len(self._pools) >= self.pool_shapes:
            self._pools.popitem(last=False)  # its slots in flight go back to a pool no longer used, and are freed
        pool = self._pools.setdefault(key, [])
        if pool:
            return pool.pop()
        with torch.inference_mode(False):  # made in an evaluation loop, it is reused outside one
            if stride is None:
                host = torch.empty(shape, dtype=dtype, pin_memory=True)
            else:
                host = torch.empty_strided(shape, stride, dtype=dtype, pin_memory=True)
        return _Slot(host, pool)


@cache
def _cuda_transfer(device: torch.device) -> _CUDATransfer:
    return _CUDATransfer(device)


def _transfer_for(device: torch.device) -> _Transfer | None:
    """The transfer for values that live on ``device``: non-blocking on CUDA; elsewhere none, a plain copy.

    A CUDA device without CUDA (a result unpickled on a CPU-only machine) gets none: nothing can come from it.
    """
    if device.type == "cuda" and torch.cuda.is_available():
        return _cuda_transfer(device)
    return None


class _CopyBuffer:
    """Copies in flight to the CPU, each folded into the state once it has landed, in the order they were put.

    Args:
        transfer: starts the copies; ``None`` copies with a plain ``.to("cpu")`` and folds at once (CPU, MPS, XLA).
        max_pending: the most copies in flight; one more first waits for the oldest.

    """

    def __init__(self, transfer: _Transfer | None, max_pending: int = 32) -> None:
        self._transfer = transfer
        self._max_pending = max_pending
        self._pending: deque[tuple[_Copy, _Fold]] = deque()

    def __len__(self) -> int:
        return len(self._pending)

    def put(self, tensor: Tensor, fold: _Fold) -> None:
        """Start copying ``tensor`` and call ``fold`` with its host copy once it has landed.

        The host copy holds the value as it was at this call: a change of ``tensor`` in place afterwards, on the
        device or on the CPU, does not reach it.
        """
        if self._transfer is None:
            fold(tensor if tensor.is_cpu else tensor.to("cpu"))
            return
        self._pending.append((self._transfer.start(tensor), fold))
        self.fold_landed()
        while len(self._pending) > self._max_pending:
            self._fold_oldest()

    def fold_landed(self) -> None:
        """Fold the copies that have landed, stopping at the first still in flight (order is kept)."""
        while self._pending and self._pending[0][0].ready():
            self._fold_oldest()

    def drain(self) -> None:
        """Wait for every copy in flight and fold it: call before any read of the state."""
        while self._pending:
            self._fold_oldest()

    def _fold_oldest(self) -> None:
        copy, fold = self._pending.popleft()
        try:
            fold(copy.wait())
        finally:
            copy.release()
