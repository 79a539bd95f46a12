import sys

import numpy as np
import pytest
import torch

from lightning_store._checks import _as_bool
from lightning_store._logged.policy import _module_policy


class _Module:
    def __init__(self, default=None):
        self.store_on_cpu_default = default


def test_optional_bool_message():
    with pytest.raises(TypeError) as info:
        _as_bool("yes", "store_on_cpu", optional=True)
    assert str(info.value) == (
        "Expected store_on_cpu to be a bool or None, got 'yes' (str)."
        " HINT: pass store_on_cpu=True or store_on_cpu=False (or leave it out)."
    )


def test_required_bool_message():
    with pytest.raises(TypeError) as info:
        _as_bool(None, "move_metrics_to_cpu", optional=False)
    assert str(info.value) == (
        "Expected move_metrics_to_cpu to be a bool, got None (NoneType)."
        " HINT: pass move_metrics_to_cpu=True or move_metrics_to_cpu=False."
    )


@pytest.mark.parametrize("value", [True, False])
def test_bools_pass(value):
    assert _as_bool(value, "x", optional=False) is value
    assert _as_bool(value, "x", optional=True) is value
    assert _as_bool(None, "x", optional=True) is None


@pytest.mark.parametrize(("value", "expected"), [(np.True_, True), (np.False_, False)])
def test_numpy_bools_pass_as_python_bools(value, expected):
    assert _as_bool(value, "x", optional=False) is expected
    assert _as_bool(value, "x", optional=True) is expected


@pytest.mark.parametrize(
    ("value", "shown"),
    [(np.int64(1), "np.int64(1) (numpy.int64)"), (torch.tensor(True), "tensor(True) (torch.Tensor)"), (1, "1 (int)")],
)
def test_a_refusal_names_the_real_type(value, shown):
    with pytest.raises(TypeError) as info:
        _as_bool(value, "store_on_cpu", optional=True)
    assert str(info.value).startswith(f"Expected store_on_cpu to be a bool or None, got {shown}.")


def test_numpy_is_not_imported_to_check_a_bool(monkeypatch):
    monkeypatch.delitem(sys.modules, "numpy")  # as if nothing had imported it
    with pytest.raises(TypeError, match=r"got 'yes' \(str\)"):
        _as_bool("yes", "store_on_cpu", optional=True)
    assert "numpy" not in sys.modules


@pytest.mark.parametrize(
    ("explicit", "module_default", "expected"),
    [(True, False, True), (False, True, False), (None, True, True), (None, False, False), (None, None, None)],
)
def test_the_module_answers_with_the_argument_then_its_default_else_leaves_it_to_the_trainer(
    explicit, module_default, expected
):
    assert _module_policy(explicit, _Module(module_default)) is expected
