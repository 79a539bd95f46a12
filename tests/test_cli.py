"""``LightningCLI`` with ``trainer.move_metrics_to_cpu``: the deprecation points at the config key or the argument,
and the run stores every logged tensor on the CPU."""

import inspect

import pytest
import pytorch_lightning.cli as cli_module
from _support import CLI_AVAILABLE, CLI_REASON, PlainLoggingModel, loader

from lightning_store import StoreOnCPUDeprecationWarning, Trainer
from lightning_store._logged.result import _StoredOnCPU

pytestmark = [pytest.mark.skipif(not CLI_AVAILABLE, reason=CLI_REASON), pytest.mark.usefixtures("kept_environment")]


class _Model(PlainLoggingModel):
    def train_dataloader(self):
        return loader()


def _deprecation(record):
    shown = [w for w in record if issubclass(w.category, StoreOnCPUDeprecationWarning)]
    assert len(shown) == 1, [str(w.message) for w in shown]
    return shown[0]


def _quiet(root):
    return [f"--trainer.default_root_dir={root}", "--trainer.logger=false", "--trainer.enable_progress_bar=false"]


def _config(tmp_path, text):
    path = tmp_path / "configs" / "config.yaml"
    path.parent.mkdir(exist_ok=True)
    path.write_text(text)
    return path


_YAML = """\
seed_everything: 0
trainer:
  max_epochs: 1
  enable_checkpointing: false
  move_metrics_to_cpu: true
"""


def test_a_config_file_is_named_and_pointed_at_by_its_line(tmp_path):
    path = _config(tmp_path, _YAML)
    with pytest.warns(StoreOnCPUDeprecationWarning) as record:
        cli = cli_module.LightningCLI(_Model, trainer_class=Trainer, run=False, args=["--config", str(path)])
    shown = _deprecation(record)
    assert (shown.filename, shown.lineno) == (str(path), 5)
    assert str(shown.message).endswith(f"(set by `trainer.move_metrics_to_cpu` in {path})")
    assert cli.trainer.move_metrics_to_cpu is True


def test_a_subcommand_run_stores_every_logged_tensor_on_the_cpu(tmp_path):
    path = _config(tmp_path, _YAML)
    with pytest.warns(StoreOnCPUDeprecationWarning) as record:
        cli = cli_module.LightningCLI(
            _Model, trainer_class=Trainer, args=["fit", "--config", str(path), *_quiet(tmp_path)]
        )
    assert (_deprecation(record).filename, _deprecation(record).lineno) == (str(path), 5)
    results = cli.trainer.fit_loop.epoch_loop._results
    assert len(results) == 25 and all(isinstance(result, _StoredOnCPU) for result in results.values())
    assert type(cli.model) is _Model


@pytest.mark.parametrize("given", [["--trainer.move_metrics_to_cpu=true"], ["--trainer.move_metrics_to_cpu", "true"]])
def test_an_argument_is_named_and_the_lightning_cli_line_pointed_at(given, tmp_path):
    path = _config(tmp_path, _YAML.replace("true", "false"))  # the argument comes after the file, and wins
    with pytest.warns(StoreOnCPUDeprecationWarning) as record:
        line = inspect.currentframe().f_lineno + 1
        cli_module.LightningCLI(_Model, trainer_class=Trainer, run=False, args=["--config", str(path), *given])
    shown = _deprecation(record)
    assert (shown.filename, shown.lineno) == (__file__, line)
    assert str(shown.message).endswith(f"(set by the argument `{' '.join(given)}`)")


def test_trainer_defaults_point_at_the_lightning_cli_line(tmp_path):
    with pytest.warns(StoreOnCPUDeprecationWarning) as record:
        line = inspect.currentframe().f_lineno + 1
        cli_module.LightningCLI(
            _Model,
            trainer_class=Trainer,
            run=False,
            trainer_defaults={"move_metrics_to_cpu": True},
            args=_quiet(tmp_path),
        )
    shown = _deprecation(record)
    assert (shown.filename, shown.lineno) == (__file__, line)
    assert str(shown.message).endswith("(set by `trainer.move_metrics_to_cpu` given to `LightningCLI`)")


def test_the_flag_off_in_a_config_file_says_nothing(tmp_path, recwarn):
    path = _config(tmp_path, _YAML.replace("true", "false"))
    cli = cli_module.LightningCLI(_Model, trainer_class=Trainer, run=False, args=["--config", str(path)])
    assert cli.trainer.move_metrics_to_cpu is False
    assert not [w for w in recwarn if issubclass(w.category, StoreOnCPUDeprecationWarning)]
