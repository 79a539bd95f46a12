"""Draws from Python's and NumPy's global generators in the worker: seen after an update, then tried on a copy.

torch's generators are guarded before a draw (``_guard.py``). Python's ``random`` and NumPy's ``np.random`` cannot
be: nothing lets one thread's calls to them be refused and not another's. Their states are compared around each
update in the worker; a change may be the update's or the training thread's, which draws at the same time. The
update is then tried again on a copy of the Metric, in the worker, while the caller waits (so that nothing else
draws): if the copy draws, the Metric does, and an error says so. The trial leaves every generator as it was.
"""

import copy
import ctypes
import random
import struct
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch.nn import Module

from lightning_store.metrics._offload.kept_warnings import _KeptWarnings
from lightning_store.metrics._offload.workers import _Inline

_HostStates = tuple[Any, Any, Any]
_MT_BYTES = 4 + 624 * 4  # a Mersenne Twister's state as Python and NumPy keep it: its position and 624 words


def _host_states(torch_too: bool = False) -> _HostStates:
    """What tells apart the states of Python's global generator, NumPy's if imported, and torch's CPU one if asked.

    Taken around every offloaded update (a row of them in a worker process), so read cheaply
    (:class:`_TwisterState`); compared by :func:`_drawn`. :func:`_saved_host_states` saves the states themselves.

    Args:
        torch_too: take torch's CPU generator's too: in a worker process, where no other thread draws from it.
    """
    numpy = sys.modules.get("numpy")
    return (
        _python_state.take(random._inst),
        _numpy_state.take(_numpy_global(numpy)) if numpy is not None else None,
        _torch_state() if torch_too else None,
    )


def _torch_state() -> bytes:
    """The state of torch's CPU generator, as bytes: compared in under a microsecond (``torch.equal``: 5 µs)."""
    state = torch.get_rng_state()
    return ctypes.string_at(state.data_ptr(), state.numel())


def _drawn(before: _HostStates, after: _HostStates) -> list[str]:
    """The names of the generators whose state differs between ``before`` and ``after``."""
    drawn = [] if before[2] == after[2] else ["torch's CPU"]
    if before[0] != after[0]:
        drawn.append("Python's `random`")
    if before[1] is not None and after[1] is not None and before[1] != after[1]:
        drawn.append("NumPy's `np.random`")
    return drawn


def _saved_host_states() -> tuple[Any, Any]:
    """Python's and NumPy's global generators' states, to be set back with :func:`_set_host_states`."""
    numpy = sys.modules.get("numpy")
    return random.getstate(), numpy.random.get_state() if numpy is not None else None


def _set_host_states(saved: tuple[Any, Any]) -> None:
    random.setstate(saved[0])
    if saved[1] is not None:
        sys.modules["numpy"].random.set_state(saved[1])


class _TwisterState:
    """What tells apart the states of one kind of Mersenne Twister generator, Python's or NumPy's legacy one.

    Their own ``getstate()`` and ``get_state()`` build a tuple or a dict of the 624 words of the state (6 to 30 µs a
    call). The words and the position are read here as they lie in memory (about 1 µs), once a check at first use
    showed, on a generator of this class's own, that they lie as the generator's own state says. Both also keep a
    spare normal deviate, which a draw may take without moving the words. Python's is an attribute, read each time.
    NumPy's comes only with its whole state: it is known without a read only when the words have not moved since
    the last full read and no deviate was kept then (keeping one moves them). Otherwise, and where the check failed,
    the state is read in full.

    Args:
        address: where a generator's words lie (``None``: they cannot be read there).
        full: a generator's words and position, and its spare deviate, from its own state.
        spare: its spare deviate alone, where that is cheap (Python's); ``None`` where it comes with ``full`` only.
        readable: a generator of the kind, seeded, and a draw from it, for the check.
    """

    def __init__(
        self,
        address: Callable[[Any], int | None],
        full: Callable[[Any], tuple[bytes, Any]],
        spare: Callable[[Any], Any] | None,
        readable: Callable[[], tuple[Any, Callable[[], Any]]],
    ) -> None:
        self.address, self.full, self.spare, self.readable = address, full, spare, readable
        self.checked: bool | None = None  # whether the words lie in memory as the state says (checked once)
        self.known: tuple[bytes, Any] | None = None  # the last state read in full, as compared (without `spare`)

    def take(self, generator: Any) -> tuple[bytes, Any]:
        if self.checked is None:
            self.checked = self._check()
        address = self.address(generator) if self.checked else None
        if address is None:
            return self.full(generator)
        words = ctypes.string_at(address, _MT_BYTES)
        if self.spare is not None:
            return words, self.spare(generator)
        known = self.known
        if known is not None and not known[1][0] and words == known[0]:  # no spare kept: its value is not used
            return known
        self.known = known = self.full(generator)
        return known

    def _check(self) -> bool:
        if sys.implementation.name != "cpython" or sys.byteorder != "little":  # `id()` an address, words as read
            return False
        try:
            generator, draw = self.readable()
            for _ in range(3):
                address = self.address(generator)
                if address is None or ctypes.string_at(address, _MT_BYTES) != self.full(generator)[0]:
                    return False
                draw()  # past a refill of the 624 words
            return True
        except Exception:
            return False


def _python_address(generator: Any) -> int | None:
    # CPython's `RandomObject`: `PyObject_HEAD; int index; uint32_t state[624];`
    return id(generator) + object.__basicsize__ if type(generator) is random.Random else None


def _python_full(generator: random.Random) -> tuple[bytes, Any]:
    words = generator.getstate()[1]  # (the 624 words, the position)
    return struct.pack("<i624I", words[624], *words[:624]), _python_spare(generator)


def _python_spare(generator: random.Random) -> Any:
    return getattr(generator, "gauss_next", None)


def _python_generator() -> tuple[Any, Callable[[], Any]]:
    generator = random.Random(0)
    return generator, lambda: generator.getrandbits(700 * 32)


def _numpy_global(numpy: Any) -> Any:
    """The legacy generator behind ``np.random.*``."""
    return numpy.random.mtrand._rand


def _numpy_address(generator: Any) -> int | None:
    # NumPy's MT19937 state: `uint32_t key[624]; int pos;`, at the address its ctypes interface gives
    bits = getattr(generator, "_bit_generator", None)
    if bits is None or type(bits).__name__ != "MT19937":
        return None
    return bits.ctypes.state_address


def _numpy_full(generator: Any) -> tuple[bytes, Any]:
    state = generator.get_state(legacy=False)
    words = bytes(state["state"]["key"].astype("<u4").data) + struct.pack("<i", state["state"]["pos"])
    return words, (state["has_gauss"], state["gauss"])


def _numpy_generator() -> tuple[Any, Callable[[], Any]]:
    numpy = sys.modules["numpy"]
    generator = numpy.random.RandomState(0)
    return generator, lambda: generator.randint(0, 2, size=700)


_python_state = _TwisterState(_python_address, _python_full, _python_spare, _python_generator)
_numpy_state = _TwisterState(_numpy_address, _numpy_full, None, _numpy_generator)


class _Suspect:
    """An update during which Python's or NumPy's generator changed: what is needed to try it again on a copy."""

    __slots__ = ("args", "drawn", "kwargs", "number", "obj")

    def __init__(self, obj: Module, number: int, args: tuple, kwargs: dict, drawn: list[str]) -> None:
        self.obj, self.number, self.args, self.kwargs, self.drawn = obj, number, args, kwargs, drawn


def _trial_draws(suspect: _Suspect) -> list[str] | None:
    """Run the suspect's update again on a copy of its Metric; the generators it drew from (``None``: no copy).

    Run in the worker while the caller waits, so that a change is the copy's. Every generator is set back after.
    """
    try:
        trial = copy.deepcopy(suspect.obj)
    except Exception:
        return None
    saved, before = _saved_host_states(), _host_states()
    try:
        with _Inline(), _KeptWarnings():  # the trial's warnings are the update's own, given already: dropped
            trial.update(*suspect.args, **suspect.kwargs)  # type: ignore[operator]
        return _drawn(before, _host_states())
    except Exception:
        return []  # it raised before any draw it would make: the original update did not raise, so nothing is known
    finally:
        _set_host_states(saved)
