import pytest

from lightning_store._policy import _check_bool, _resolve, _result_key


class _Module:
    def __init__(self, default=None):
        self.store_on_cpu_default = default


class _Trainer:
    def __init__(self, flag):
        self.move_metrics_to_cpu = flag


def test_optional_bool_message():
    with pytest.raises(TypeError) as info:
        _check_bool("yes", "store_on_cpu", optional=True)
    assert str(info.value) == (
        "Expected store_on_cpu to be a bool or None, got 'yes' (str)."
        " HINT: pass store_on_cpu=True or store_on_cpu=False (or leave it out)."
    )


def test_required_bool_message():
    with pytest.raises(TypeError) as info:
        _check_bool(None, "move_metrics_to_cpu", optional=False)
    assert str(info.value) == (
        "Expected move_metrics_to_cpu to be a bool, got None (NoneType)."
        " HINT: pass move_metrics_to_cpu=True or move_metrics_to_cpu=False."
    )


@pytest.mark.parametrize("value", [True, False])
def test_bools_pass(value):
    _check_bool(value, "x", optional=False)
    _check_bool(value, "x", optional=True)
    _check_bool(None, "x", optional=True)


@pytest.mark.parametrize(
    ("explicit", "module_default", "flag", "expected"),
    [
        (True, False, False, True),
        (False, True, True, False),
        (None, True, False, True),
        (None, False, True, False),
        (None, None, True, True),
        (None, None, False, False),
    ],
)
def test_resolution_order_is_argument_then_module_then_trainer(explicit, module_default, flag, expected):
    assert _resolve(explicit, _Module(module_default), _Trainer(flag)) is expected


def test_a_plain_trainer_or_none_means_false():
    assert _resolve(None, _Module(), object()) is False
    assert _resolve(None, _Module(), None) is False


def test_the_key_is_lightnings():
    assert _result_key("training_step", "loss", True, None) == "training_step.loss"
    assert _result_key("validation_step", "acc", True, 1) == "validation_step.acc.1"
    assert _result_key("validation_step", "acc", False, 1) == "validation_step.acc"
