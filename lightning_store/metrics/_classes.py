"""The classes put in front of a configured Metric's own: made once, named as it, pickled by the Metric's own class."""

from typing import Any

_made: dict[tuple[type, type], type] = {}  # (front, the Metric's own class) -> the class made
_own: dict[type, type] = {}  # the class made -> the Metric's own class


def _in_front(front: type, own_class: type, attribute: str) -> type:
    """``front`` put in front of ``own_class`` (a Metric's, a collection's), with the name of ``own_class``.

    ``attribute`` is the Python object ``front`` keeps on the instance, which TorchScript must leave alone.
    """
    if (front, own_class) not in _made:
        names = {
            "__module__": own_class.__module__,
            "__qualname__": own_class.__qualname__,
            # what TorchScript leaves alone: the class's own, and what the front adds (`metric_state` is a property
            # of torchmetrics >= 1.1 only; `attribute` a Python object it would try to compile)
            "__jit_unused_properties__": [*getattr(own_class, "__jit_unused_properties__", []), "metric_state"],
            "__jit_ignored_attributes__": [*getattr(own_class, "__jit_ignored_attributes__", []), attribute],
        }
        made = type(own_class.__name__, (front, own_class), names)
        _made[front, own_class] = made
        _own[made] = own_class
    return _made[front, own_class]


def _own_class(made: type) -> type:
    """The class a made class was put in front of."""
    return _own[made]


def _reduce(obj: Any, front: type, state: dict[str, Any]) -> tuple[Any, ...]:
    """What pickle keeps of ``obj``: the class is made at run time, so pickle makes it again from the own class."""
    return _rebuild, (front, _own[type(obj)]), state


def _rebuild(front: type, own_class: type) -> Any:
    """An empty object of the class made, for pickle to fill in with ``__setstate__``."""
    made: Any = _in_front(front, own_class, getattr(front, "_kept_attribute"))  # noqa: B009
    return made.__new__(made)
