"""See where logged values live: one row per key Lightning keeps, with its device, bytes, reduction and sync."""

import textwrap
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, fields
from typing import Any

import torch
from torch import Tensor
from torchmetrics import Metric

from lightning_store._logged.collection import _loop_results
from lightning_store._logged.result import _StoredOnCPU, _syncs
from lightning_store.metrics._reads import (
    _configured_by_flag,
    _metrics_in,
    _queue_of,
    _settle_states,
    _stores_states_on_cpu,
)

__all__ = ["KeyStorage", "format_storage_report", "storage_report"]


@dataclass(frozen=True)
class KeyStorage:
    """Where Lightning keeps one logged key, and how much it holds there.

    Attributes:
        loop: ``"train"``, ``"fit_validation"``, ``"validate"`` or ``"test"``.
        hook: the hook that logged it, such as ``"training_step"``.
        name: the name given to ``self.log``.
        dataloader_idx: the dataloader it was logged for, if there are several.
        kind: ``"tensor"`` (tensors and numbers) or the class name of a logged ``Metric``.
        store_on_cpu: whether lightning-store keeps the key's state on the CPU: a tensor key's stored value, or,
            for a ``Metric``, its list states (or those of the Metrics it wraps); ``set_by`` says what asked for it.
        set_by: what keeps it on the CPU: ``"store_on_cpu"`` (the module's ``store_on_cpu=True`` or
            ``store_on_cpu_default``), ``"flag"`` (``Trainer(move_metrics_to_cpu=True)``, for a tensor key the
            module left open or a Metric it configured), :func:`~lightning_store.store_states_on_cpu` or
            :func:`~lightning_store.offload_to_cpu`; ``"-"`` for nothing.
        device: where its tensors are now (``"cpu"``, ``"cuda:0"``...); ``"-"`` before any is kept.
        bytes: the bytes its tensors hold there.
        reduce_fx: the reduction over steps (``"mean"``, ``"sum"``...), or ``"compute"`` for a ``Metric``.
        sync_dist: whether it is reduced across processes.
        offloaded: for a ``Metric``, whether it (or a collection holding it) was given to
            :func:`~lightning_store.offload_to_cpu`, which keeps all of its states on the CPU.
        pending_updates: for an offloaded ``Metric``, its updates queued and not yet run when the row was made,
            after its bytes were counted: reading its states waits for the updates queued before, so this is 0
            unless another thread queued updates meanwhile.
        waited_s: for an offloaded ``Metric``, the seconds its ``update`` calls have waited, in all, for the queue
            to have room (``max_pending``) or, with a worker process, the shared memory its inputs go through.
        worker_behind: for an offloaded ``Metric``, whether its worker fell behind the calls over the latest 50
            updates (they waited for room for half of their time or more): the step then waits for the Metric's
            work, and takes about as long as the update does in the worker (a ``StoreOnCPUWarning`` says so,
            once).

    Example:
        >>> row = KeyStorage("train", "training_step", "loss", None, "tensor",
        ...                  True, "store_on_cpu", "cpu", 16, "mean", False)
        >>> row.device, row.bytes
        ('cpu', 16)

    """

    loop: str
    hook: str
    name: str
    dataloader_idx: int | None
    kind: str
    store_on_cpu: bool
    set_by: str
    device: str
    bytes: int
    reduce_fx: str
    sync_dist: bool
    offloaded: bool = False
    pending_updates: int = 0
    waited_s: float = 0.0
    worker_behind: bool = False


def storage_report(trainer: Any) -> list[KeyStorage]:
    """One row per key that ``trainer`` keeps logged state for, in every loop that has logged.

    Call it while the loop you look at runs, from a callback's ``on_train_batch_end`` or
    ``on_validation_batch_end`` (or that loop's ``on_*_epoch_end``). A logged ``Metric`` is reset when its loop's
    epoch ends: in a fit, the validation epoch ends before ``on_train_epoch_end``, where the validation Metrics'
    rows read ``"-"`` and 0 bytes. When a loop ends, Lightning moves all of its logged state to the CPU, whatever
    the policy. A Metric logged in several loops (the same object for validation and test, say) holds the state of
    the loop that runs: its rows in the other loops read ``"-"`` and 0 bytes.

    Args:
        trainer: a ``Trainer`` of either Lightning namespace, fitted or running.

    Returns:
        The rows, loop by loop, in the order the keys were first logged.

    Example:
        >>> import pytorch_lightning as pl
        >>> storage_report(pl.Trainer(logger=False))
        []

    """
    loops = list(_loops(trainer))
    running = _running_loop(trainer)
    # a Metric logged in several loops (validation and test, say) holds the state of the loop that runs now
    held_by_running = {
        id(r.value) for name, results in loops if name == running for r in results.values() if not r.is_tensor
    }
    return [
        _row(loop, result, held=loop == running or id(result.value) not in held_by_running)
        for loop, results in loops
        for result in results.values()
    ]


def _running_loop(trainer: Any) -> str | None:
    """The name of the loop that runs now (or ran last), as in :attr:`KeyStorage.loop`; ``None`` for none."""
    function, stage = (getattr(value, "value", None) for value in (trainer.state.fn, trainer.state.stage))
    if function == "fit":
        return "fit_validation" if stage in ("sanity_check", "validate") else "train"
    return function if function in ("validate", "test") else None


# the columns `format_storage_report` leaves out first to fit a width: those that say least, last to first
_KEPT_LONGEST = ("name", "set_by", "device", "bytes", "loop", "kind", "pending_updates", "hook", "store_on_cpu")
_DEFAULTS = {
    "dataloader_idx": "-",
    "sync_dist": "False",
    "offloaded": "False",
    "pending_updates": "0",
    "worker_behind": "False",
}


def format_storage_report(rows: Iterable[KeyStorage], width: int | None = None) -> str:
    r"""A plain-text table of ``rows``, one line per key, for a terminal or a bug report.

    Args:
        rows: what :func:`storage_report` returned.
        width: the most characters a line may have (a terminal's width, say): columns are left out until the
            table fits, first those in which no row says anything (``dataloader_idx`` all ``-``, ``offloaded``
            all ``False``...), then the least telling, and a last line names them. ``None``: every column.

    Returns:
        The table, with a header line.

    Example:
        >>> print(*format_storage_report([]).split(), sep="\n")  # doctest: +ELLIPSIS
        loop
        hook
        ...
        worker_behind

    """
    header = [field.name for field in fields(KeyStorage)]
    columns = {name: [name] for name in header}
    for row in rows:
        for name, value in asdict(row).items():
            columns[name].append(_cell(value))
    left_out = []
    for name in _drop_order(columns):
        if width is None or _table_width(columns) <= width:
            break
        left_out.append(columns.pop(name)[0])
    table = _render(columns)
    if left_out:
        note = f"(left out to fit the width: {', '.join(left_out)})"
        table += "\n" + "\n".join(textwrap.wrap(note, max(width or 0, 20)))
    return table


def _drop_order(columns: dict[str, list[str]]) -> list[str]:
    """The columns in the order to leave them out: those in which no row says anything, then the least telling."""
    silent = [
        name
        for name, default in (*_DEFAULTS.items(), ("waited_s", "0.000"), ("set_by", "-"))
        if all(cell == default for cell in columns[name][1:])
    ]
    by_use = [name for name in columns if name not in _KEPT_LONGEST] + list(reversed(_KEPT_LONGEST))
    return [*silent, *(name for name in by_use if name not in silent and name != "name")]


def _table_width(columns: dict[str, list[str]]) -> int:
    return sum(max(map(len, cells)) for cells in columns.values()) + 2 * (len(columns) - 1)


def _render(columns: dict[str, list[str]]) -> str:
    widths = [max(map(len, cells)) for cells in columns.values()]
    lines = zip(*columns.values(), strict=True)
    rendered = ("  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True)) for line in lines)
    return "\n".join(line.rstrip() for line in rendered)


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    return f"{value:.3f}" if isinstance(value, float) else str(value)


def _loops(trainer: Any) -> Iterator[tuple[str, dict[str, Any]]]:
    for name, results in _loop_results(trainer).items():
        if results:
            yield name, results


def _row(loop: str, result: Any, held: bool = True) -> KeyStorage:
    """The row of ``result``; ``held=False`` for a Metric whose state another loop holds now: nothing counted."""
    meta = result.meta
    queue = None if result.is_tensor else _queue_of(result.value)
    # for an offloaded Metric, this waits for the updates queued before
    tensors = list(_held_tensors(result)) if held else []
    devices = sorted({str(t.device) for t in tensors})
    set_by = _set_by(result, queue is not None)
    return KeyStorage(
        loop=loop,
        hook=meta.fx.split(".")[0],
        name=meta.name,
        dataloader_idx=meta.dataloader_idx,
        kind="tensor" if result.is_tensor else type(result.value).__name__,
        store_on_cpu=set_by != "-",
        set_by=set_by,
        device=",".join(devices) or "-",
        bytes=sum(t.numel() * t.element_size() for t in tensors),
        reduce_fx=meta.reduce_fx.__name__ if result.is_tensor else "compute",
        sync_dist=_syncs(meta.sync) if result.is_tensor else _metric_syncs(result.value),
        offloaded=queue is not None,
        pending_updates=0 if queue is None else queue.pending,  # read after the states: consistent with the bytes
        waited_s=0.0 if queue is None else queue.waited_s,
        worker_behind=queue is not None and queue.lag.behind,
    )


def _set_by(result: Any, offloaded: bool) -> str:
    """What keeps the key's state on the CPU (see :attr:`KeyStorage.set_by`)."""
    if result.is_tensor:
        if not isinstance(result, _StoredOnCPU):
            return "-"
        return "flag" if result._by_flag else "store_on_cpu"
    if offloaded:
        return "offload_to_cpu"
    configured = [m for m in _metrics_in(result.value) if _stores_states_on_cpu(m)]
    if not configured:
        return "-"
    return "flag" if all(map(_configured_by_flag, configured)) else "store_states_on_cpu"


def _metric_syncs(metric: Metric) -> bool:
    """Whether a ``Metric`` reduces across processes when computed: it does by itself, once distributed."""
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    return bool(distributed and getattr(metric, "sync_on_compute", True))


def _held_tensors(result: Any) -> Iterator[Tensor]:
    """The distinct tensors a ``_ResultMetric`` keeps: its states, step value and computed value, or a Metric's."""
    if result.is_tensor:
        candidates: list[Any] = [result.value, getattr(result, "cumulated_batch_size", None)]
        candidates += [result._forward_cache, result._computed]
    else:
        candidates = []
        for metric in _metrics_in(result.value):
            _settle_states(metric)  # copies in flight to the CPU are counted where they land
            candidates += [metric._forward_cache, metric._computed]
            for name in metric._defaults:  # `Metric.metric_state` is torchmetrics >= 1.1
                state = getattr(metric, name)
                candidates.extend(state if isinstance(state, list) else [state])
    seen: set[int] = set()
    for tensor in candidates:
        if isinstance(tensor, Tensor) and id(tensor) not in seen:
            seen.add(id(tensor))
            yield tensor
