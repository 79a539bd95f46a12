import warnings

import pytest

from lightning_store import StoreOnCPUDeprecationWarning, StoreOnCPUWarning, StorePolicyError
from lightning_store.warnings import _deprecate_once, _warn_once


def test_the_classes_are_what_users_filter_on():
    assert issubclass(StoreOnCPUWarning, UserWarning)
    assert issubclass(StoreOnCPUDeprecationWarning, DeprecationWarning)
    assert issubclass(StorePolicyError, ValueError)


def _user_line():
    _warn_once("a message", stacklevel=3)  # 2 is this function, 3 its caller


def test_a_warning_is_shown_once_and_points_at_the_requested_frame():
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        _user_line()
        _user_line()
    assert [(w.category, str(w.message)) for w in record] == [(StoreOnCPUWarning, "a message")]
    assert record[0].filename == __file__


def test_a_deprecation_is_shown_once_with_its_class():
    with pytest.warns(StoreOnCPUDeprecationWarning, match="old") as record:
        _deprecate_once("old")
        _deprecate_once("old")
    assert len(record) == 1
    assert record[0].filename == __file__
