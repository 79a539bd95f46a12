"""Draws from Python's and NumPy's global generators in the worker: seen after an update, then tried on a copy.

torch's generators are guarded before a draw (``_guard.py``). Python's ``random`` and NumPy's ``np.random`` cannot
be: nothing lets one thread's calls to them be refused and not another's. Their states are compared around each
update in the worker; a change may be the update's or the training thread's, which draws at the same time. The
update is then tried again on a copy of the Metric, in the worker, while the caller waits (so that nothing else
draws): if the copy draws, the Metric does, and an error says so. The trial leaves every generator as it was.
"""

import copy
import random
import sys
from typing import Any

import torch
from torch.nn import Module

from lightning_store.metrics._offload.kept_warnings import _kept_warnings
from lightning_store.metrics._offload.workers import _Inline

_HostStates = tuple[Any, Any, Any]


def _host_states(torch_too: bool = False) -> _HostStates:
    """The states of Python's global generator, of NumPy's if it is imported, and of torch's CPU one if asked.

    Args:
        torch_too: take torch's CPU generator's too: in a worker process, where no other thread draws from it.
    """
    numpy = sys.modules.get("numpy")
    return (
        random.getstate(),
        numpy.random.get_state(legacy=False) if numpy is not None else None,
        torch.get_rng_state() if torch_too else None,
    )


def _set_host_states(states: _HostStates) -> None:
    random.setstate(states[0])
    if states[1] is not None:
        sys.modules["numpy"].random.set_state(states[1])


def _drawn(before: _HostStates, after: _HostStates) -> list[str]:
    """The names of the generators whose state differs between ``before`` and ``after``."""
    drawn = [] if before[2] is None or torch.equal(before[2], after[2]) else ["torch's CPU"]
    if before[0] != after[0]:
        drawn.append("Python's `random`")
    if before[1] is not None and after[1] is not None and not _same_numpy(before[1], after[1]):
        drawn.append("NumPy's `np.random`")
    return drawn


def _same_numpy(before: dict, after: dict) -> bool:
    # {"bit_generator", "state": {"key", "pos"}, "has_gauss", "gauss"} (legacy=False)
    return (
        before["state"]["pos"] == after["state"]["pos"]
        and before["has_gauss"] == after["has_gauss"]
        and before["gauss"] == after["gauss"]
        and bool((before["state"]["key"] == after["state"]["key"]).all())
    )


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
