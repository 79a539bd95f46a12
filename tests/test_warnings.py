import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
from _support import CLI_AVAILABLE, CLI_REASON, HANG_S

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


_BUILDS_TRAINERS = """
import warnings

import lightning_store
from _support import LoggingModel


def build(root):
    warnings.warn("another deprecation", DeprecationWarning)  # still hidden: Python's default filters are kept
    lightning_store.Trainer(move_metrics_to_cpu=True, logger=False, default_root_dir=root)
    lightning_store.Trainer(move_metrics_to_cpu=True, logger=False, default_root_dir=root)  # once


def build_through_cli(root):
    from pytorch_lightning.cli import LightningCLI

    lightning_store.warnings._cache.clear()  # a fresh process, as far as the once-only cache goes
    args = ["--trainer.move_metrics_to_cpu=true", "--trainer.logger=false", f"--trainer.default_root_dir={root}"]
    LightningCLI(LoggingModel, trainer_class=lightning_store.Trainer, run=False, args=args)
"""


def _run_with_default_filters(tmp_path, main):
    (tmp_path / "builds_trainers.py").write_text(_BUILDS_TRAINERS)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}
    tests, root = Path(__file__).parent, Path(__file__).parent.parent
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), str(tests), str(root)])
    result = subprocess.run(
        [sys.executable, "-c", main], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=HANG_S
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "another deprecation" not in result.stderr
    return [line for line in result.stderr.splitlines() if "`Trainer(move_metrics_to_cpu=True)` is deprecated" in line]


def test_the_deprecation_shows_under_default_filters_from_a_module(tmp_path):
    shown = _run_with_default_filters(tmp_path, "import builds_trainers as b, sys; b.build(sys.argv[0])")
    assert len(shown) == 1, shown
    assert (
        "builds_trainers.py" in shown[0]
        and "StoreOnCPUDeprecationWarning: `Trainer(move_metrics_to_cpu=True)`" in shown[0]
    )


@pytest.mark.skipif(not CLI_AVAILABLE, reason=CLI_REASON)
def test_the_deprecation_shows_under_default_filters_through_lightning_cli(tmp_path):
    shown = _run_with_default_filters(tmp_path, "import builds_trainers as b, sys; b.build_through_cli(sys.argv[0])")
    assert len(shown) == 1, shown
    # the argument is named, at the user's `LightningCLI(...)` line, not Lightning's cli.py
    line = _BUILDS_TRAINERS.splitlines().index(
        "    LightningCLI(LoggingModel, trainer_class=lightning_store.Trainer, run=False, args=args)"
    )
    assert f"builds_trainers.py:{line + 1}: StoreOnCPUDeprecationWarning" in shown[0]
    assert "(set by the argument `--trainer.move_metrics_to_cpu=true`)" in shown[0]


def test_the_deprecation_can_still_be_filtered_by_its_class(tmp_path):
    main = (
        "import warnings, lightning_store, builds_trainers as b, sys;"
        " warnings.filterwarnings('ignore', category=lightning_store.StoreOnCPUDeprecationWarning);"
        " b.build(sys.argv[0])"
    )
    assert _run_with_default_filters(tmp_path, main) == []
