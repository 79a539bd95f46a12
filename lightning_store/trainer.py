"""A ``pytorch_lightning.Trainer`` that still accepts the deprecated ``move_metrics_to_cpu`` flag."""

import pytorch_lightning as pl

from lightning_store._flag import _init_with_flag, _MoveMetricsToCPUFlag

__all__ = ["Trainer"]


class Trainer(_MoveMetricsToCPUFlag, pl.Trainer):
    """``pytorch_lightning.Trainer`` plus ``move_metrics_to_cpu``, removed from Lightning in 2.0.

    Args:
        *args: as for ``pytorch_lightning.Trainer``.
        move_metrics_to_cpu: deprecated. ``True`` makes ``store_on_cpu`` default to True for the tensors and
            numbers that :class:`~lightning_store.StoreOnCPUMixin` modules log, with a deprecation warning.
        **kwargs: as for ``pytorch_lightning.Trainer``.

    Raises:
        TypeError: if ``move_metrics_to_cpu`` is not a bool.

    Example:
        >>> trainer = Trainer(move_metrics_to_cpu=False, max_epochs=1, logger=False)
        >>> trainer.move_metrics_to_cpu
        False

    """

    __init__ = _init_with_flag(pl.Trainer)
