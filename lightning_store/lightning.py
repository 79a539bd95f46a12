"""lightning-store for the ``lightning.pytorch`` namespace (package ``lightning``): its ``Trainer`` with the flag.

``StoreOnCPUMixin`` works with a LightningModule of either namespace; it is re-exported here for convenience.
"""

from lightning_store._compat import _check_lightning_version, _installed_version

try:
    import lightning.pytorch as _lightning_pytorch
except ImportError as err:
    installed = _installed_version("lightning")
    if installed is None:
        raise ImportError(
            "`lightning_store.lightning` is for the `lightning` package, which is not installed."
            " HINT: pip install lightning, or use `lightning_store.Trainer` with `pytorch_lightning`."
        ) from err
    # installed, but it does not import: first a release outside the range, else the error itself, chained
    _check_lightning_version("lightning")
    hint = (
        " HINT: Lightning releases before 2.4 import `pkg_resources`, which recent setuptools no longer ships:"
        " pip install 'setuptools<82'."
        if getattr(err, "name", None) == "pkg_resources"
        else " HINT: fix the error above, which `import lightning.pytorch` raises on its own."
    )
    raise ImportError(
        f"`lightning` {installed} is installed, but `import lightning.pytorch` failed: {err}." + hint
    ) from err

from lightning_store._flag.hooks import _MoveMetricsToCPUHooks
from lightning_store._flag.init import _init_with_flag
from lightning_store._flag.namespace import _refusing_the_other_namespace
from lightning_store.mixin import StoreOnCPUMixin

_check_lightning_version("lightning")

__all__ = ["StoreOnCPUMixin", "Trainer"]


class _MoveMetricsToCPU(_MoveMetricsToCPUHooks, _lightning_pytorch.Callback):
    """The callback that ``Trainer(move_metrics_to_cpu=True)`` adds to itself."""


class Trainer(_lightning_pytorch.Trainer):
    """``lightning.pytorch.Trainer`` plus ``move_metrics_to_cpu``, removed from Lightning in 2.0.

    The same as :class:`lightning_store.Trainer`, for modules that subclass ``lightning.pytorch.LightningModule``.

    Args:
        *args: as for ``lightning.pytorch.Trainer``.
        move_metrics_to_cpu: deprecated. ``True`` stores on the CPU every tensor and number that the
            LightningModule logs, as ``self.log(..., store_on_cpu=True)`` does, and the list states of its
            torchmetrics Metrics, as :func:`~lightning_store.store_states_on_cpu` does; with a deprecation warning.
        **kwargs: as for ``lightning.pytorch.Trainer``.

    Raises:
        TypeError: if ``move_metrics_to_cpu`` is not a bool; from ``fit``, ``validate``, ``test`` and ``predict``,
            if the model is a LightningModule of ``pytorch_lightning`` (the error names the Trainer to import).

    Example:
        >>> trainer = Trainer(move_metrics_to_cpu=False, max_epochs=1, logger=False)
        >>> isinstance(trainer, _lightning_pytorch.Trainer)
        True
    """

    move_metrics_to_cpu: bool

    __init__ = _init_with_flag(_lightning_pytorch.Trainer, _MoveMetricsToCPU)
    fit = _refusing_the_other_namespace(_lightning_pytorch.Trainer.fit, "lightning.pytorch")
    validate = _refusing_the_other_namespace(_lightning_pytorch.Trainer.validate, "lightning.pytorch")
    test = _refusing_the_other_namespace(_lightning_pytorch.Trainer.test, "lightning.pytorch")
    predict = _refusing_the_other_namespace(_lightning_pytorch.Trainer.predict, "lightning.pytorch")
