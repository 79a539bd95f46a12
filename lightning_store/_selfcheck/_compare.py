"""Compare what two fits logged: bit for bit, or (off the CPU) within a relative tolerance that is reported."""

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

# Off the CPU, the plain run reduces on the accelerator and the CPU-stored run on the CPU: the same float32
# operations in the same order, but a device may round a division or a fused operation differently in the last bit.
RTOL = 1e-6


@dataclass
class Comparison:
    """How the values of one run compare with those of a reference run."""

    compared: int = 0
    exact: int = 0
    max_rel_diff: float = 0.0
    missing: list[str] = field(default_factory=list)
    extra: list[str] = field(default_factory=list)
    different: list[str] = field(default_factory=list)

    def passed(self, rtol: float) -> bool:
        """No key missing or extra, every value exact, or within ``rtol`` relative difference."""
        return not (self.missing or self.extra or self.different) and self.max_rel_diff <= rtol

    def describe(self) -> str:
        """One line: how many values, and how they matched (or the first ones that didn't)."""
        if self.missing or self.extra:
            return f"keys differ: missing {self.missing[:3]}, unexpected {self.extra[:3]}"
        if self.different:
            return f"{len(self.different)} of {self.compared} values differ, e.g. {'; '.join(self.different[:3])}"
        if self.exact == self.compared:
            return f"{self.compared} values, bit for bit"
        return (
            f"{self.compared} values, {self.exact} bit for bit, the others within {self.max_rel_diff:.1e}"
            f" relative difference (tolerance {RTOL:.0e})"
        )

    def as_data(self) -> dict[str, Any]:
        return {
            "compared": self.compared,
            "bit_for_bit": self.exact,
            "max_rel_diff": self.max_rel_diff,
            "missing": self.missing,
            "extra": self.extra,
            "different": self.different[:10],
        }


def compare(expected: Mapping[str, float], actual: Mapping[str, float], rtol: float) -> Comparison:
    """Compare ``actual`` with ``expected`` key by key (NaN equals NaN)."""
    result = Comparison(missing=sorted(set(expected) - set(actual)), extra=sorted(set(actual) - set(expected)))
    for key in sorted(set(expected) & set(actual)):
        want, got = expected[key], actual[key]
        result.compared += 1
        if want == got or (math.isnan(want) and math.isnan(got)):
            result.exact += 1
            continue
        rel = abs(got - want) / max(abs(want), abs(got))
        result.max_rel_diff = max(result.max_rel_diff, rel)
        if rel > rtol:
            result.different.append(f"{key}: {got!r} instead of {want!r}")
    return result


def as_float(value: Any) -> float:
    """A logged value (tensor or number) as a Python float, read on the CPU."""
    if isinstance(value, torch.Tensor):
        return float(value.detach().to("cpu", torch.float64).item())
    return float(value)
