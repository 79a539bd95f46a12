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
from typing import Any

import torch
from torch.nn import Module

from lightning_store.metrics._offload.kept_warnings import _kept_warnings
from lightning_store.metrics._offload.thread.worker import _Inline

_HostStates = tuple[Any, Any, Any]
_MT_BYTES = 624 * 4 + 4  # NumPy's MT19937 state: `uint32_t key[624]; int pos;`


def _host_states(torch_too: bool = False) -> _HostStates:
    """The states of Python's global generator, of NumPy's if it is imported, and of torch's CPU one if asked.

    Taken before and after every offloaded update, so cheaply: NumPy's as :class:`_NumpyState` reads it.

    Args:
        torch_too: take torch's CPU generator's too: in a worker process, where no other thread draws from it.
    """
    numpy = sys.modules.get("numpy")
    return (
        random.getstate(),
        _numpy_state.take(numpy) if numpy is not None else None,
        torch.get_rng_state() if torch_too else None,
    )


def _set_host_states(states: _HostStates) -> None:
    random.setstate(states[0])
    if states[1] is not None:
        sys.modules["numpy"].random.set_state(states[1][1])


def _drawn(before: _HostStates, after: _HostStates) -> list[str]:
    """The names of the generators whose state differs between ``before`` and ``after``."""
    drawn = [] if before[2] is None or torch.equal(before[2], after[2]) else ["torch's CPU"]
    if before[0] != after[0]:
        drawn.append("Python's `random`")
    if before[1] is not None and after[1] is not None and before[1][0] != after[1][0]:
        drawn.append("NumPy's `np.random`")
    return drawn


class _NumpyState:
    """NumPy's legacy global generator (``np.random.*``), its state as bytes that compare equal when it is unchanged.

    ``get_state()`` builds a dict and copies the 624 words of the Mersenne Twister (tens of µs); the words and the
    position are read here as they lie in memory, through the bit generator's ctypes interface (about 1 µs), once a
    check at first use showed that they lie as NumPy's own ``state`` gives them. The legacy generator also keeps a
    spare normal deviate (``has_gauss``, ``gauss``), which a draw may use without moving the Twister: that part is
    known without a read only when the Twister has not moved since the last full read and no deviate was kept then
    (keeping one moves the Twister). Otherwise, and where the check failed, the state is read in full.
    """

    def __init__(self) -> None:
        # the last state read in full: as compared (words, has_gauss, gauss), and as `get_state(legacy=False)` gave it
        self.known: tuple[tuple[bytes, int, float], dict] | None = None
        self.readable: bool | None = None  # whether the words read in memory are the state's (checked once)

    def take(self, numpy: Any) -> tuple[tuple[bytes, int, float], dict]:
        """The state: what tells it apart, and the state itself (to set it back)."""
        known = self.known
        if known is not None and not known[0][1] and self._words(numpy) == known[0][0]:
            return known
        full = numpy.random.get_state(legacy=False)
        self.known = known = ((_words_of(full), full["has_gauss"], full["gauss"]), full)
        return known

    def _words(self, numpy: Any) -> bytes | None:
        """The Twister's words and position as they lie in memory, or ``None`` where they are not read so."""
        if self.readable is None:
            self.readable = _reads_as_its_state(numpy)
        generator = _global_bit_generator(numpy)
        if not self.readable or generator is None:
            return None
        return ctypes.string_at(generator.ctypes.state_address, _MT_BYTES)


def _global_bit_generator(numpy: Any) -> Any:
    """The bit generator behind ``np.random.*``, if it is NumPy's MT19937 (it is unless replaced)."""
    getter = getattr(numpy.random, "get_bit_generator", None)  # NumPy >= 1.25
    generator = getter() if getter is not None else getattr(numpy.random.mtrand._rand, "_bit_generator", None)
    return generator if type(generator) is numpy.random.MT19937 else None


def _words_of(state: dict) -> bytes:
    """An MT19937 state (``legacy=False``) as it lies in memory: its key, then its position."""
    return bytes(state["state"]["key"].astype("<u4").data) + struct.pack("<i", state["state"]["pos"])


def _reads_as_its_state(numpy: Any) -> bool:
    """Whether an MT19937's memory reads as its ``state`` says, on one of this function's own, as it draws."""
    if sys.byteorder != "little":
        return False
    try:
        generator = numpy.random.MT19937(0)
        for _ in range(3):
            if ctypes.string_at(generator.ctypes.state_address, _MT_BYTES) != _words_of(
                {"state": generator.state["state"]}
            ):
                return False
            generator.random_raw(700)  # past a refill of the 624 words
        return True
    except Exception:
        return False


_numpy_state = _NumpyState()


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
    before = _host_states()
    try:
        with _Inline(), _kept_warnings():  # the trial's warnings are the update's own, given already: dropped
            trial.update(*suspect.args, **suspect.kwargs)  # type: ignore[operator]
        return _drawn(before, _host_states())
    except Exception:
        return []  # it raised before any draw it would make: the original update did not raise, so nothing is known
    finally:
        _set_host_states(before)
