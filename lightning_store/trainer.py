"""A ``pytorch_lightning.Trainer`` that still accepts the deprecated ``move_metrics_to_cpu`` flag."""

import pytorch_lightning as pl

from lightning_store._flag.hooks import _MoveMetricsToCPUHooks
from lightning_store._flag.init import _init_with_flag
from lightning_store._flag.namespace import _refusing_the_other_namespace

__all__ = ["Trainer"]


class _MoveMetricsToCPU(_MoveMetricsToCPUHooks, pl.Callback):
    """The callback that ``Trainer(move_metrics_to_cpu=True)`` adds to itself."""


class Trainer(pl.Trainer):
    """``pytorch_lightning.Trainer`` plus ``move_metrics_to_cpu``, removed from Lightning in 2.0.

    Args:
        *args: as for ``pytorch_lightning.Trainer``.
        move_metrics_to_cpu: deprecated. ``True`` stores on the CPU every tensor and number that the
            LightningModule logs, as ``self.log(..., store_on_cpu=True)`` does, and the list states of its
            torchmetrics Metrics, as :func:`~lightning_store.store_states_on_cpu` does; with a deprecation warning.
        **kwargs: as for ``pytorch_lightning.Trainer``.

    Raises:
        TypeError: if ``move_metrics_to_cpu`` is not a bool; from ``fit``, ``validate``, ``test`` and ``predict``,
            if the model is a LightningModule of ``lightning.pytorch`` (the error names the Trainer to import).

    Example:
        >>> trainer = Trainer(move_metrics_to_cpu=False, max_epochs=1, logger=False)
        >>> trainer.move_metrics_to_cpu
        False

    """

    move_metrics_to_cpu: bool

    __init__ = _init_with_flag(pl.Trainer, _MoveMetricsToCPU)
    fit = _refusing_the_other_namespace(pl.Trainer.fit, "pytorch_lightning")
    validate = _refusing_the_other_namespace(pl.Trainer.validate, "pytorch_lightning")
    test = _refusing_the_other_namespace(pl.Trainer.test, "pytorch_lightning")
    predict = _refusing_the_other_namespace(pl.Trainer.predict, "pytorch_lightning")
