"""See where logged values live: one row per key Lightning keeps, with its device, bytes, reduction and sync."""

from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, fields
from typing import Any

import torch
from torch import Tensor
from torchmetrics import Metric

from lightning_store._collection import _loop_results
from lightning_store._result import _StoredOnCPU, _syncs
from lightning_store.metrics._offloaded import _queue_of
from lightning_store.metrics.states import _settle_states, _stores_states_on_cpu

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
        store_on_cpu: whether the key is stored on the CPU by ``store_on_cpu``, or, for a ``Metric``, whether its
            list states (or those of the Metrics it wraps) are, by :func:`~lightning_store.store_states_on_cpu` or
            :func:`~lightning_store.offload_to_cpu`.
        device: where its tensors are now (``"cpu"``, ``"cuda:0"``...); ``"-"`` before any is kept.
        bytes: the bytes its tensors hold there.
        reduce_fx: the reduction over steps (``"mean"``, ``"sum"``...), or ``"compute"`` for a ``Metric``.
        sync_dist: whether it is reduced across processes.
        offloaded: for a ``Metric``, whether it (or a collection holding it) was given to
            :func:`~lightning_store.offload_to_cpu`, which keeps all of its states on the CPU.
        pending_updates: for an offloaded ``Metric``, its updates queued and not yet run, when the row was made.
        waited_s: for an offloaded ``Metric``, the seconds its ``update`` calls have waited, in all, for the queue
            to have room (``max_pending``).

    Example:
        >>> KeyStorage("train", "training_step", "loss", None, "tensor", True, "cpu", 16, "mean", False).device
        'cpu'

    """

    loop: str
    hook: str
    name: str
    dataloader_idx: int | None
    kind: str
    store_on_cpu: bool
    device: str
    bytes: int
    reduce_fx: str
    sync_dist: bool
    offloaded: bool = False
    pending_updates: int = 0
    waited_s: float = 0.0


def storage_report(trainer: Any) -> list[KeyStorage]:
    """One row per key that ``trainer`` keeps logged state for, in every loop that has logged.

    Call it while the Trainer runs (from a callback, say) to see where values live during training: when a loop
    ends, Lightning moves all of its logged state to the CPU, whatever the policy.

    Args:
        trainer: a ``Trainer`` of either Lightning namespace, fitted or running.

    Returns:
        The rows, loop by loop, in the order the keys were first logged.

    Example:
        >>> import pytorch_lightning as pl
        >>> storage_report(pl.Trainer(logger=False))
        []

    """
    return [_row(loop, result) for loop, results in _loops(trainer) for result in results.values()]


def format_storage_report(rows: Iterable[KeyStorage]) -> str:
    r"""A plain-text table of ``rows``, one line per key, for a terminal or a bug report.

    Args:
        rows: what :func:`storage_report` returned.

    Returns:
        The table, with a header line.

    Example:
        >>> print(*format_storage_report([]).split(), sep="\n")  # doctest: +ELLIPSIS
        loop
        hook
        ...
        waited_s

    """
    header = [field.name for field in fields(KeyStorage)]
    lines = [header] + [[_cell(v) for v in asdict(row).values()] for row in rows]
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
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


def _row(loop: str, result: Any) -> KeyStorage:
    meta = result.meta
    queue = None if result.is_tensor else _queue_of(result.value)
    pending = 0 if queue is None else queue.pending  # before the states are read, which waits for the queue
    tensors = list(_held_tensors(result))
    devices = sorted({str(t.device) for t in tensors})
    return KeyStorage(
        loop=loop,
        hook=meta.fx.split(".")[0],
        name=meta.name,
        dataloader_idx=meta.dataloader_idx,
        kind="tensor" if result.is_tensor else type(result.value).__name__,
        store_on_cpu=isinstance(result, _StoredOnCPU)
        or (not result.is_tensor and (queue is not None or _keeps_states_on_cpu(result.value))),
        device=",".join(devices) or "-",
        bytes=sum(t.numel() * t.element_size() for t in tensors),
        reduce_fx=meta.reduce_fx.__name__ if result.is_tensor else "compute",
        sync_dist=_syncs(meta.sync) if result.is_tensor else _metric_syncs(result.value),
        offloaded=queue is not None,
        pending_updates=pending,
        waited_s=0.0 if queue is None else queue.waited_s,
    )


def _metrics_in(metric: Metric) -> list[Metric]:
    """A logged Metric and, for a wrapper (``BinaryTargetTransformer``, ``auroc + ap``...), the Metrics it holds."""
    return [m for m in metric.modules() if isinstance(m, Metric)]


def _keeps_states_on_cpu(metric: Metric) -> bool:
    """Whether a logged Metric, or a Metric it wraps, was given to ``store_states_on_cpu``."""
    return any(_stores_states_on_cpu(m) for m in _metrics_in(metric))


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
