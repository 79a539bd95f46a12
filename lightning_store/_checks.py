"""The validators of lightning-store's options: each error says what was passed and how to fix it."""

import sys
from typing import Any


def _as_bool(value: Any, name: str, *, optional: bool) -> bool | None:
    """``value`` as a ``bool`` (a ``numpy.bool_`` too) or ``None`` if ``optional``; else a ``TypeError`` that says how.

    Config systems hand out numpy booleans; numpy is not imported for them: a ``numpy.bool_`` exists only once numpy
    has been imported by someone else.
    """
    if value is True or value is False or (optional and value is None):
        return value
    numpy = sys.modules.get("numpy")
    if numpy is not None and isinstance(value, numpy.bool_):
        return bool(value)
    expected = "a bool or None" if optional else "a bool"
    raise TypeError(
        f"Expected {name} to be {expected}, got {value!r} ({_type_name(value)})."
        f" HINT: pass {name}=True or {name}=False{' (or leave it out)' if optional else ''}."
    )


def _type_name(value: Any) -> str:
    """``str`` for builtins, else the qualified name a user would import: ``numpy.int64``, ``torch.Tensor``."""
    kind = type(value)
    return kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"


def _check_positive_int(value: Any, name: str, hint: str) -> None:
    """Raise an error that says how to fix ``value`` (the argument ``name``) unless it is a positive ``int``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"Expected {name} to be an int, got {value!r} ({_type_name(value)}). HINT: {hint}")
    if value <= 0:
        raise ValueError(f"Expected {name} to be positive, got {value}. HINT: {hint}")
