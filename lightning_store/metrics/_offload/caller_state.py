"""What torch keeps per thread, taken at an offloaded update's call and applied in the worker while it runs."""

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from lightning_store.metrics._offload.guard import _Refused

_Key = torch._C.DispatchKey
_KeySet = torch._C.DispatchKeySet
# a dispatch mode sets these (the worker's own guard, or a mode of the caller's, which is not carried)
_MODE_KEYS = _KeySet(_Key.Python).add(_Key.PythonTLSSnapshot)
# the autocast key of each device type torch names one for (more on newer releases)
_AUTOCAST_KEYS = {
    device: getattr(_Key, key)
    for device, key in {
        "cpu": "AutocastCPU",
        "cuda": "AutocastCUDA",
        "xpu": "AutocastXPU",
        "ipu": "AutocastIPU",
        "hpu": "AutocastHPU",
        "xla": "AutocastXLA",
        "mps": "AutocastMPS",
        "privateuseone": "AutocastPrivateUse1",
    }.items()
    if hasattr(_Key, key)
}
_SUBNORMAL, _ONE = 1e-310, 1.0  # a product of the two is 0.0 where the thread flushes subnormal numbers to zero
# what tells two key sets apart: their bits (torch >= 2.4), else their names
_identity: Callable[[Any], Any] = _KeySet.raw_repr if hasattr(_KeySet, "raw_repr") else repr


def _dispatch_keys() -> tuple[Any, Any]:
    """The dispatch keys this thread adds and removes (autocast, inference mode...), a dispatch mode's left out."""
    return (
        torch._C._dispatch_tls_local_include_set() - _MODE_KEYS,
        torch._C._dispatch_tls_local_exclude_set() - _MODE_KEYS,
    )


# the identities of a thread's own key sets -> those of the sets carried, and the device types autocast is on for
_CARRIED: dict[tuple[Any, Any], tuple[tuple[Any, Any], tuple[str, ...]]] = {}


def _thread_keys() -> tuple[tuple[Any, Any], tuple[str, ...]]:
    """The identities of :func:`_dispatch_keys`' two sets, and the device types autocast is on for in this thread.

    Looked up by the identities of the thread's own sets, for few are seen: an update's call takes them each time.
    """
    raw = (_identity(torch._C._dispatch_tls_local_include_set()), _identity(torch._C._dispatch_tls_local_exclude_set()))
    known = _CARRIED.get(raw)
    if known is None:
        included, excluded = _dispatch_keys()
        autocast_on = tuple(device for device, key in _AUTOCAST_KEYS.items() if not excluded.has(key))
        known = ((_identity(included), _identity(excluded)), autocast_on)
        if len(_CARRIED) < 256:
            _CARRIED[raw] = known
    return known


def _carried_keys() -> tuple[Any, Any]:
    """The identities of :func:`_dispatch_keys`' two sets (see :func:`_thread_keys`)."""
    return _thread_keys()[0]


def _key_names(identity: Any) -> set[str]:
    """The names of the keys in a key set known by its identity (see ``_identity``)."""
    text = identity if isinstance(identity, str) else repr(_KeySet.from_raw_repr(identity))
    inside = text[text.index("(") + 1 : text.rindex(")")]
    return {name.strip() for name in inside.split(",") if name.strip()}


def _flushes_subnormals() -> bool:
    """Whether this thread computes with subnormal numbers flushed to zero (``torch.set_flush_denormal``)."""
    return _SUBNORMAL * _ONE == 0.0


def _autocast_dtype(device: str) -> torch.dtype:
    if hasattr(torch, "get_autocast_dtype"):  # torch >= 2.4
        return torch.get_autocast_dtype(device)
    getter = {"cpu": "get_autocast_cpu_dtype", "cuda": "get_autocast_gpu_dtype"}.get(
        device, f"get_autocast_{device}_dtype"
    )
    return getattr(torch, getter)()


class _CallerState:
    """The thread-local torch state of an update's caller, which the worker runs the update with.

    Taken as a whole where torch keeps it as a whole, so that no part of it is missed:

    - the dispatch keys the thread adds and removes, compared in the worker once the rest is applied: autocast on
      or off for every device type, inference mode, and any other key a context manager sets (one this class does
      not carry fails the update, with the keys it differs by);
    - what goes with them: the dtype autocast casts to on each device type where it is on, and whether it caches;
      grad mode; inference mode;
    - the number of torch threads: torch fixes a thread's own when it first runs a parallel op, and a reduction
      split over another number of threads adds in another order (Lightning's DDP launcher calls
      ``torch.set_num_threads`` when the fit starts);
    - whether subnormal numbers are flushed to zero (``torch.set_flush_denormal``), a setting of the CPU thread.

    torch's default dtype is a setting of the process, not of a thread (Lightning's ``"bf16-true"`` and
    ``"64-true"`` precisions change it around each step): it is taken too, and the worker's guard refuses an op
    that would run under another (see ``_guard.py``).
    """

    __slots__ = ("autocast", "cache", "default_dtype", "flush", "grad", "inference", "keys", "threads")

    def __init__(self) -> None:
        self.threads = torch.get_num_threads()
        self.grad = torch.is_grad_enabled()
        self.inference = torch.is_inference_mode_enabled()
        self.keys, autocast_on = _thread_keys()  # values, which a worker process can be sent
        self.autocast = tuple((device, _autocast_dtype(device)) for device in autocast_on)
        self.cache = torch.is_autocast_cache_enabled()
        self.flush = _flushes_subnormals()
        self.default_dtype = torch.get_default_dtype()

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _CallerState) and self._values() == other._values()

    def _values(self) -> tuple:
        return (
            self.threads,
            self.grad,
            self.inference,
            self.keys,
            self.autocast,
            self.cache,
            self.flush,
            self.default_dtype,
        )

    __hash__ = None  # type: ignore[assignment]

    @contextlib.contextmanager
    def applied(self, default_dtype: bool = False) -> Iterator[None]:
        """This thread's torch state set to the caller's while the block runs, and set back after it.

        Args:
            default_dtype: whether to set torch's default dtype too: in a worker process, whose only thread that
                runs torch ops is the one running the update.
        """
        if torch.get_num_threads() != self.threads:
            torch.set_num_threads(self.threads)  # kept after the block: the next update is most likely the same
        flush = _flushes_subnormals()
        if flush != self.flush:
            torch.set_flush_denormal(self.flush)
        dtype = torch.get_default_dtype()
        if default_dtype and dtype != self.default_dtype:
            torch.set_default_dtype(self.default_dtype)
        try:
            if self._in_modes():  # most often: nothing to enter (an ExitStack costs 1 µs)
                self._check_carried()
                yield
                return
            with contextlib.ExitStack() as stack:  # a mode entered only where it differs: each costs ops µs
                if torch.is_inference_mode_enabled() != self.inference:
                    stack.enter_context(torch.inference_mode(self.inference))
                if torch.is_grad_enabled() != self.grad:
                    stack.enter_context(torch.set_grad_enabled(self.grad))
                for device, dtype in self.autocast:
                    stack.enter_context(torch.autocast(device, dtype=dtype, cache_enabled=self.cache))
                self._check_carried()
                yield
        finally:
            if flush != self.flush:
                torch.set_flush_denormal(flush)
            if default_dtype and dtype != self.default_dtype:
                torch.set_default_dtype(dtype)

    def in_force(self, default_dtype: bool = False) -> bool:
        """Whether this thread is in this state already, so that :meth:`applied` would change nothing.

        Args:
            default_dtype: whether torch's default dtype counts (see :meth:`applied`).
        """
        return (
            torch.get_num_threads() == self.threads
            and _flushes_subnormals() == self.flush
            and (not default_dtype or torch.get_default_dtype() == self.default_dtype)
            and self._in_modes()
            and _carried_keys() == self.keys
        )

    def _in_modes(self) -> bool:
        """Whether this thread is in the caller's inference and grad modes, with autocast off as the caller's."""
        return (
            not self.autocast
            and torch.is_inference_mode_enabled() == self.inference
            and torch.is_grad_enabled() == self.grad
        )

    def _check_carried(self) -> None:
        here = _carried_keys()
        if here != self.keys:
            differ = set.union(*(_key_names(a) ^ _key_names(b) for a, b in zip(here, self.keys, strict=True)))
            raise _Refused(
                "it was called under thread-local torch state that lightning-store cannot carry into its offload"
                f" worker: the dispatch keys DispatchKeySet({', '.join(sorted(differ))}) differ from the caller's"
                " (a context such as a functorch transform). Run in the worker, its values could differ from the"
                " plain Metric's.",
                "call `update` outside that context, or keep this Metric as it is (not offloaded).",
            )
