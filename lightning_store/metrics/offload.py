"""``offload_to_cpu``: any torchmetrics Metric's update, states and compute on the CPU, off the training step."""

import pickle
from typing import Any, Literal, TypeVar, get_args

from torch.nn import Module
from torchmetrics import Metric, MetricCollection
from torchmetrics.wrappers import BootStrapper, MetricTracker

from lightning_store._checks import _check_positive_int
from lightning_store.metrics._configured import _queue_of, _remember_plain_settings, _settling
from lightning_store.metrics._gather import _is_gather_on_device, gather_on_device
from lightning_store.metrics._offload.front import _offloaded_class, _offloading
from lightning_store.metrics._offload.process.ended import _main_defines
from lightning_store.metrics._offload.process.queue import _ProcessQueue
from lightning_store.metrics._offload.queue import DEFAULT_MAX_PENDING, _Queue
from lightning_store.metrics._offload.thread.queue import _ThreadQueue
from lightning_store.metrics._states_on_cpu import _StatesOnCPU
from lightning_store.metrics.states import _ACCEPTED, _check_configurable

__all__ = ["offload_to_cpu"]

_Offloadable = TypeVar("_Offloadable", Metric, MetricCollection, MetricTracker)
_Worker = Literal["process", "thread"]  # what runs the updates: a process of its own, or a thread
_EXAMPLE = "`self.auroc = offload_to_cpu(BinaryAUROC(thresholds=200))`"


def offload_to_cpu(
    metric: _Offloadable, *, max_pending: int | None = None, worker: _Worker = "process"
) -> _Offloadable:
    """Run ``metric``'s updates on the CPU, in a background worker: a process of its own (the default) or a thread.

    ``update()`` copies its inputs to the CPU, queues the update and returns; the worker runs the Metric's own
    ``update``, in call order. Every state lives on the CPU. Every read (``compute``, ``reset``, ``state_dict``, a
    state, pickling...) waits for the updates queued before it, and every value is, bit for bit, that of the same
    Metric run plainly on the CPU. Under DDP, ``compute`` syncs with :func:`~lightning_store.gather_on_device`.
    An update that fails in the worker raises again at the next call on the Metric.

    A worker process shares no interpreter lock with the training step, which pays where the step runs Python, as
    a host launching GPU kernels does; it starts as DataLoader workers do with ``spawn``, so a script guards its
    code with ``if __name__ == "__main__":``. A worker thread (``worker="thread"``) starts at once and needs
    neither pickling nor the guard, and helps only when the step spends its time in tensor ops. Which to use, what
    is carried into the worker, and the refusals: :doc:`the guide </guides/offload-to-cpu>`.

    Args:
        metric (Metric | MetricCollection | MetricTracker): a ``torchmetrics.Metric`` (a wrapper too), a
            ``MetricCollection`` or a ``MetricTracker``, configured in place with every Metric it holds, which
            share its queue.
        max_pending: the most updates that wait for the worker; one more waits in ``update`` until one has run.
            ``None``: 64 for a worker process, whose updates wait with their inputs in shared memory of a size of its
            own, whatever their count; 16 for a worker thread, each of whose updates holds a copy of its inputs.
        worker: ``"process"``, a process of its own, which runs the updates of every Metric offloaded to it, or
            ``"thread"``, a thread of this process.

    Returns:
        Metric | MetricCollection | MetricTracker: ``metric`` itself.

    Raises:
        TypeError: if ``metric`` is not one of those (a class, say), ``max_pending`` is not an int, or
            ``worker="process"`` gets a Metric that cannot be pickled, or whose class a worker process cannot import
            (defined in ``__main__`` of ``python -c``, stdin or a notebook).
        ValueError: if ``max_pending`` is not positive, ``worker`` is neither, or ``metric`` cannot be offloaded (a
            ``BootStrapper``, one with a ``dist_sync_fn`` of its own, one given to ``store_states_on_cpu``, or one
            offloaded already to the other worker).

    Example:
        >>> import torch
        >>> from torchmetrics.classification import BinaryAUROC
        >>> auroc = offload_to_cpu(BinaryAUROC(thresholds=200))
        >>> auroc.update(torch.tensor([0.1, 0.8, 0.4]), torch.tensor([0, 1, 1]))
        >>> auroc.compute()
        tensor(1.)

    """
    _check_worker(worker)
    if max_pending is None:
        max_pending = DEFAULT_MAX_PENDING[worker]
    _check_max_pending(max_pending, worker)
    _check_configurable(metric, "offload_to_cpu", _EXAMPLE)
    queue = _queue_of(metric)
    if queue is not None:  # offloaded already: only the bound changes
        if queue.worker != worker:
            raise ValueError(
                f"offload_to_cpu() got a {type(metric).__name__} offloaded already with worker={queue.worker!r}:"
                f" its updates cannot move to worker={worker!r}. HINT: pass worker={queue.worker!r}, or offload a"
                " new Metric."
            )
        queue.max_pending = max_pending
        return metric
    members = [m for m in metric.modules() if isinstance(m, _ACCEPTED)]
    for member in members:
        _check_member(member, metric)
    if worker == "process":
        _check_pickles(metric)
        queue = _ProcessQueue(max_pending, name=type(metric).__name__)
        queue.root = metric
    else:
        queue = _ThreadQueue(max_pending, name=type(metric).__name__)
    for member in members:
        _configure_offloaded(member, queue)
    return metric


def _configure_offloaded(member: Module, queue: _Queue) -> None:
    if isinstance(member, Metric):
        _remember_plain_settings(member, "dist_sync_fn")  # what a checkpoint gets
    member.__dict__["_offload"] = queue
    member.__class__ = _offloaded_class(type(member))
    if isinstance(member, Metric):
        member.update = _offloading(member, member.update)  # type: ignore[method-assign]
        member.compute = _settling(member, member.compute)  # type: ignore[method-assign]
        if member.dist_sync_fn is None:
            member.dist_sync_fn = gather_on_device
    member.cpu()


def _check_worker(worker: Any) -> None:
    if not isinstance(worker, str) or worker not in get_args(_Worker):
        raise ValueError(
            f"Expected worker to be 'process' or 'thread', got {worker!r}. HINT: 'process' (the default) runs the"
            " updates in a process of their own, which pays where the step or the Metric runs Python; 'thread' in a"
            " thread of this process, which starts at once and needs no pickling."
        )


def _check_pickles(metric: Module) -> None:
    in_main = _main_defines(metric)
    if in_main is not None:
        raise TypeError(
            f"offload_to_cpu(worker='process') got a {type(metric).__name__} whose class {in_main} is defined in"
            " `__main__` of a program run with `python -c`, from stdin or in a notebook: the worker process cannot"
            " import it. HINT: pass worker='thread', which works there, or define the class in a module the worker"
            " process can import."
        )
    try:
        pickle.dumps(metric)
    except Exception as error:
        raise TypeError(
            f"offload_to_cpu(worker='process') got a {type(metric).__name__} that cannot be pickled ({error}): the"
            " worker process gets a copy of it. HINT: keep only picklable attributes on the Metric (no lambda, no"
            " open file), or pass worker='thread'."
        ) from error


def _check_max_pending(max_pending: Any, worker: _Worker) -> None:
    hint = f"pass a number of updates, such as max_pending={DEFAULT_MAX_PENDING[worker]} (worker={worker!r}'s default)."
    _check_positive_int(max_pending, "max_pending", hint)


def _check_member(member: Module, root: Module) -> None:
    """Raise an error that says why unless ``member`` (``root``, or a Metric inside it) can be offloaded."""
    name = type(member).__name__
    inside = "" if member is root else f" (inside the {type(root).__name__} given)"
    if _queue_of(member) is not None:
        raise ValueError(
            f"offload_to_cpu() got a {type(root).__name__} holding a {name} offloaded on its own: its updates would"
            f" run in two queues. HINT: offload only the {type(root).__name__}, which offloads every Metric inside."
        )
    if isinstance(member, _StatesOnCPU):
        raise ValueError(
            f"offload_to_cpu() got a {name}{inside} given to store_states_on_cpu, whose list states it copies to"
            " the CPU after each update on its device. Offloading keeps every state on the CPU, which includes"
            f" that. HINT: drop store_states_on_cpu and call only offload_to_cpu, as in {_EXAMPLE}."
        )
    if isinstance(member, BootStrapper):
        raise ValueError(
            f"offload_to_cpu() got a BootStrapper{inside}: its update draws random numbers to resample the batch."
            " Run in the background, it would draw them at another time than the plain Metric, changing both its"
            " values and the random numbers your model draws. HINT: keep the BootStrapper as it is (not offloaded)."
        )
    sync_fn = getattr(member, "dist_sync_fn", None)
    if sync_fn is not None and not _is_gather_on_device(sync_fn):
        raise ValueError(
            f"offload_to_cpu() got a {name}{inside} with dist_sync_fn={sync_fn!r}: its states live on the CPU, and"
            " their sync must copy them to the collective's device (NCCL refuses CPU tensors), which"
            " lightning_store.gather_on_device does and another function may not. HINT: drop dist_sync_fn;"
            " offload_to_cpu sets it to gather_on_device."
        )
