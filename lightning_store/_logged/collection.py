"""Where a Trainer keeps logged results: Lightning's ``_ResultCollection``, with some keys stored on the CPU."""

from typing import Any

import torch

from lightning_store._compat import _in_front_of, _remade
from lightning_store._logged.policy import _requested
from lightning_store._logged.result import _policy_changed, _stored_on_cpu_class, _StoredOnCPU


class _StoringResults:
    """Put in front of Lightning's ``_ResultCollection`` (see :func:`_install_storing`): one storage policy per call.

    A tensor logged with ``store_on_cpu=True`` (the module's answer, in ``_logged.policy._requested``) or, where the
    module leaves it open, under ``Trainer(move_metrics_to_cpu=True)`` (``_move_metrics_to_cpu``) is kept by a
    :class:`~._result._StoredOnCPU`; every other call is Lightning's own. A ``Metric`` is always Lightning's.

    The policy is applied where Lightning's ``log`` hands the value to the key's result, ``update_metrics``: by then
    Lightning has registered the key (a new one has never been updated) and found the batch size.
    """

    _move_metrics_to_cpu: bool = False  # the Trainer's flag: the policy of a call the module leaves open
    _sync_device: torch.device  # where collectives run and where logged values come from
    _base_class: type  # set on each class `_storing_class` makes

    def update_metrics(self, key: str, value: Any, batch_size: int) -> None:
        store = _requested.get()
        if store is None:
            store = self._move_metrics_to_cpu
        result = self[key]  # type: ignore[index]
        if isinstance(result, _StoredOnCPU):
            if not store:
                raise _policy_changed(result.meta.name, result.meta.fx.split(".")[0], now=False)
        elif store and result.is_tensor:
            if result._update_count or result.has_reset:  # logged before, as Lightning stores it
                raise _policy_changed(result.meta.name, result.meta.fx.split(".")[0], now=True)
            # a new key: Lightning's first update (and sync) runs on the collective's device, as for every later
            # value; then the state moves to the CPU like any value
            device = self._sync_device
            if value.device != device:
                value = value.to(device)
                result.to(device)  # in place, as Lightning moved it to the value's device
            super().update_metrics(key, value, batch_size)  # type: ignore[misc]
            stored = _stored_on_cpu_class(type(result)).adopt(result, device)
            stored._by_flag = _requested.get() is None  # for `storage_report`: the flag's, not the module's
            self[key] = stored  # type: ignore[index]
            return
        super().update_metrics(key, value, batch_size)  # type: ignore[misc]

    def __reduce_ex__(self, protocol: Any) -> tuple[Any, ...]:
        # the class is made at run time, so pickle could not find it by name: it is made again from Lightning's
        return _remade, (_StoringResults, self._base_class), dict(vars(self)), None, iter(self.items())  # type: ignore[attr-defined]


def _storing_class(collection_class: type) -> type[_StoringResults]:
    """``_StoringResults`` put in front of the ``_ResultCollection`` of the Lightning namespace in use (made once)."""
    return _in_front_of(_StoringResults, collection_class)


def _install_storing(results: Any, sync_device: torch.device, *, move_metrics_to_cpu: bool | None = None) -> None:
    """Make ``results``, one of a Trainer's result collections, store on the CPU what its calls ask to, in place.

    Lightning holds the collection in its loops: its class is changed, not the object, so every reference to it
    stays valid. A call that asks for nothing is Lightning's own, so the change is harmless once the run ends.

    Args:
        results: a ``_ResultCollection`` of either Lightning namespace.
        sync_device: the strategy's ``root_device``.
        move_metrics_to_cpu: the Trainer's flag; ``None`` leaves it as it is (``False`` at first).
    """
    if not isinstance(results, _StoringResults):
        results.__class__ = _storing_class(type(results))
    results._sync_device = sync_device
    if move_metrics_to_cpu is not None:
        results._move_metrics_to_cpu = move_metrics_to_cpu


def _install_on(trainer: Any, *, move_metrics_to_cpu: bool | None = None) -> None:
    """:func:`_install_storing` on the result collection of every loop of ``trainer`` that logs."""
    device = trainer.strategy.root_device
    for results in _loop_results(trainer).values():
        _install_storing(results, device, move_metrics_to_cpu=move_metrics_to_cpu)


def _loop_results(trainer: Any) -> dict[str, Any]:
    """The result collection of each loop of ``trainer`` that logs, by the loop's name in ``storage_report``."""
    epoch_loop = trainer.fit_loop.epoch_loop
    loops = {
        "train": epoch_loop,
        "fit_validation": getattr(epoch_loop, "val_loop", None),
        "validate": trainer.validate_loop,
        "test": trainer.test_loop,
    }
    found = {name: getattr(loop, "_results", None) for name, loop in loops.items()}
    return {name: results for name, results in found.items() if results is not None}
