"""``store_states_on_cpu``: a torchmetrics ``Metric`` whose list states live on the CPU, synced on the device."""

import functools
from typing import Any, TypeVar

from torch.nn import Module
from torchmetrics import Metric, MetricCollection
from torchmetrics.wrappers import MetricTracker

from lightning_store._checks import _type_name
from lightning_store.metrics._configured import _owns_list_states, _queue_of, _remember_plain_settings, _settling
from lightning_store.metrics._gather import (
    DEFAULT_CHUNK_BYTES,
    _check_chunk_bytes,
    _is_gather_on_device,
    gather_on_device,
)
from lightning_store.metrics._states_on_cpu import (
    _class_for,
    _collect,
    _collecting,
    _CPUStates,
    _land_copies,
    _StatesOnCPU,
)
from lightning_store.warnings import _warn_once

__all__ = ["gather_on_device", "store_states_on_cpu"]

_Configurable = TypeVar("_Configurable", Metric, MetricCollection, MetricTracker)
_ACCEPTED = (Metric, MetricCollection, MetricTracker)
_EXAMPLE = "`self.auroc = store_states_on_cpu(BinaryAUROC(thresholds=None))`"


def _check_configurable(metric: Any, function: str, example: str) -> None:
    """Raise an error that says how to fix ``metric`` unless ``function`` (``store_states_on_cpu``...) takes it."""
    if isinstance(metric, type) and issubclass(metric, _ACCEPTED):
        raise TypeError(
            f"{function}() got the class {metric.__name__} itself, not a Metric made from it."
            f" HINT: call the class, with parentheses: `{function}({metric.__name__}(...))`, as in {example}."
        )
    if not isinstance(metric, _ACCEPTED):
        raise TypeError(
            f"{function}() takes a torchmetrics Metric (a wrapper too), MetricCollection or MetricTracker,"
            f" got {_type_name(metric)}. HINT: pass the Metric itself, as in {example}."
        )


def _holders(root: Module) -> list[Metric]:
    """The Metrics in ``root`` (itself, or in a collection or wrapper, at any depth) with list states of their own.

    An offloaded Metric is none: ``offload_to_cpu`` keeps every state on the CPU already.
    """
    return [m for m in root.modules() if isinstance(m, Metric) and _owns_list_states(m) and _queue_of(m) is None]


def _check_dist_sync_fn(metric: Metric) -> None:
    if not _is_gather_on_device(metric.dist_sync_fn) and metric.dist_sync_fn is not None:
        raise ValueError(
            f"store_states_on_cpu() got a {type(metric).__name__} with dist_sync_fn={metric.dist_sync_fn!r}: its"
            " list states live on the CPU, and their sync must copy them to the collective's device (NCCL refuses"
            " CPU tensors), which lightning_store.gather_on_device does and another function may not."
            " HINT: drop dist_sync_fn; store_states_on_cpu sets it to gather_on_device."
        )


def _configure_states_on_cpu(metric: Metric, states: _CPUStates, chunk_bytes: int) -> None:
    if isinstance(metric, _StatesOnCPU):
        if metric._cpu_states is not states:  # now configured with others
            _land_copies(metric)
            metric._cpu_states = states
    else:
        _remember_plain_settings(metric, "dist_sync_fn", "compute_on_cpu")  # what a checkpoint gets
        metric.compute_on_cpu = False  # superseded: its blocking copies after each update are not needed
        metric.__class__ = _class_for(type(metric))
        metric._cpu_states = states
        metric.update = _collecting(metric, metric.update)  # type: ignore[method-assign]
        metric.compute = _settling(metric, metric.compute)  # type: ignore[method-assign]
    metric.dist_sync_fn = functools.partial(gather_on_device, chunk_bytes=chunk_bytes)
    _collect(metric)  # what it gathered on a device before


def store_states_on_cpu(metric: _Configurable, *, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> _Configurable:
    """Keep the list states of ``metric`` on the CPU, without a host sync per update; sync them on the device.

    List states are what grows over an epoch: every prediction and target of ``BinaryAUROC(thresholds=None)``,
    ``CatMetric`` or the retrieval metrics, and the lists kept one element per item (``ROUGEScore``). After each
    ``update``, what it added is copied to the CPU through the same non-blocking buffer as
    ``self.log(..., store_on_cpu=True)``; every read first completes the copies in flight. Tensor states (sums,
    counts) stay where the Metric computes. ``compute`` runs on the CPU, as with ``compute_on_cpu=True``, which
    this supersedes. On the CPU, every value is bit for bit that of the Metric unconfigured.

    Across processes, the list states are gathered on the collective's device by :func:`gather_on_device`, in
    chunks of at most ``chunk_bytes``. Wrappers and collections, nested at any depth, are searched: every Metric in
    ``metric`` that holds list states is configured in place. Calling this again only sets ``chunk_bytes``. What
    moves the states, how they sync, and what works with the configured Metric:
    :doc:`the guide </guides/store-states-on-cpu>`.

    Args:
        metric (Metric | MetricCollection | MetricTracker): a ``torchmetrics.Metric`` (a wrapper too), a
            ``MetricCollection`` (with compute groups, their shared states stay shared) or a ``MetricTracker``.
            Metrics added to it later are not configured, but the copies a ``MetricTracker`` makes of a configured
            Metric are.
        chunk_bytes: the most device memory a chunk of the gather takes, when processes sync.

    Returns:
        Metric | MetricCollection | MetricTracker: ``metric`` itself.

    Raises:
        TypeError: if ``metric`` is not one of those (a class, say), or ``chunk_bytes`` is not an int.
        ValueError: if ``chunk_bytes`` is not positive, or a Metric with list states has a ``dist_sync_fn`` of its
            own (the sync of CPU states needs :func:`gather_on_device`).

    Example:
        >>> import torch
        >>> from torchmetrics.classification import BinaryAUROC
        >>> auroc = store_states_on_cpu(BinaryAUROC(thresholds=None))
        >>> auroc.update(torch.tensor([0.1, 0.8, 0.4]), torch.tensor([0, 1, 1]))
        >>> auroc.preds[0].device, auroc.compute()
        (device(type='cpu'), tensor(1.))

    """
    _check_chunk_bytes(chunk_bytes)
    _check_configurable(metric, "store_states_on_cpu", _EXAMPLE)
    holders = _holders(metric)
    if not holders and any(
        _queue_of(m) is not None for m in metric.modules()
    ):  # offloaded: its states are on the CPU already
        return metric
    if not holders:
        _warn_once(
            f"store_states_on_cpu() got a {type(metric).__name__}, which has no list state: there is nothing to"
            " move to the CPU. Its tensor states (sums, counts, maxima...) are a few bytes and stay where it"
            " computes. HINT: store_states_on_cpu is for Metrics that keep every prediction of an epoch, such as"
            " BinaryAUROC(thresholds=None); leave this one as it is.",
            stacklevel=3,  # the user's line: above `store_states_on_cpu`
        )
        return metric
    for holder in holders:
        _check_dist_sync_fn(holder)
    _configure_together(holders, chunk_bytes)
    return metric


def _configure_together(holders: list[Metric], chunk_bytes: int = DEFAULT_CHUNK_BYTES, by_flag: bool = False) -> None:
    """Configure ``holders``, Metrics with list states of their own, with one buffer: those already configured's.

    ``by_flag``: ``Trainer(move_metrics_to_cpu=True)`` configures them, not the user (for ``storage_report``).
    """
    configured = [m._cpu_states for m in holders if isinstance(m, _StatesOnCPU)]
    states = configured[0] if configured else _CPUStates(by_flag)
    for holder in holders:
        _configure_states_on_cpu(holder, states, chunk_bytes)
