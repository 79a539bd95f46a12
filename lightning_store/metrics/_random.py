"""Refuse, before its first queued update, a Metric whose update draws from a global random number generator."""

import copy
import random
import sys
from typing import Any

import torch
from torch.nn import Module

from lightning_store.metrics._inputs import _cloned_on_cpu
from lightning_store.metrics._worker import _Inline


def _generator_states() -> list[Any]:
    """The states of the generators an update could draw from: torch's on the CPU, Python's, NumPy's if imported."""
    states: list[Any] = [torch.random.get_rng_state(), random.getstate()]
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        states.append(numpy.random.get_state())
    return states


def _set_generator_states(states: list[Any]) -> None:
    torch.random.set_rng_state(states[0])
    random.setstate(states[1])
    if len(states) > 2:
        sys.modules["numpy"].random.set_state(states[2])


def _same(before: list[Any], after: list[Any]) -> bool:
    if not torch.equal(before[0], after[0]) or before[1] != after[1]:
        return False
    if len(before) > 2:  # NumPy's: (name, keys, position, has_gauss, cached_gaussian)
        numpy = sys.modules["numpy"]
        return all(numpy.array_equal(a, b) for a, b in zip(before[2], after[2], strict=True))
    return True


def _refuse_random_numbers(obj: Module, args: tuple, kwargs: dict) -> bool:
    """Run the first update on a copy of ``obj``, here and now; raise if it drew random numbers.

    Run later, in the worker, such an update would draw at another point of the random stream than the plain
    Metric does, and move the stream the model draws from: both would silently change. The copy's update leaves
    every generator as it was. An error the update raises is raised here, at the call, as the plain Metric's.

    A Metric that cannot be copied (one holding a ``torch.Generator`` on torch < 2.4, say) runs its first update
    itself, here, as the plain Metric would: the random numbers are then the plain ones, and the error, if it drew
    any, says that this update was applied. Returns whether it ran so.
    """
    try:
        trial = copy.deepcopy(obj)
    except Exception:
        trial = None
    before = _generator_states()
    restore = trial is not None
    try:
        with _Inline():
            args, kwargs = _cloned_on_cpu(args, kwargs)
            (trial if trial is not None else obj).update(*args, **kwargs)  # type: ignore[operator]
        drew = not _same(before, _generator_states())
    finally:
        if restore:
            _set_generator_states(before)
    if drew:
        name = type(obj).__name__
        applied = "" if trial is not None else " This first update was applied, in the caller's thread."
        raise ValueError(
            f"offload_to_cpu() got a {name} whose update draws random numbers from a global generator (torch's,"
            " Python's or NumPy's): run in the background, it would draw them at another time than the plain"
            f" Metric, changing both its values and the random numbers your model draws.{applied} HINT: keep the"
            f" {name} as it is (not offloaded), or give its update a `torch.Generator` of its own, seeded once."
        )
    return trial is None
