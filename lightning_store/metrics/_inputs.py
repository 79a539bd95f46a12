"""An update's inputs, taken as they are at the call: copied to the CPU through the buffer's transfer, landed later."""

from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor

from lightning_store._buffer import _Copy, _Landed, _transfer_for


class _InFlight:
    """A tensor input's copy to the CPU, started at the call (on CUDA, without waiting for it)."""

    __slots__ = ("copy",)

    def __init__(self, tensor: Tensor) -> None:
        tensor = tensor.detach()
        transfer = _transfer_for(tensor.device)
        self.copy: _Copy = transfer.start(tensor) if transfer is not None else _Landed(tensor)

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
