"""Check 8: a Metric given to ``offload_to_cpu`` gives the plain Metric's values, on the CPU, without a host sync."""

from dataclasses import asdict, dataclass, field
from functools import partial
from typing import Any, cast

import torch
from torch import Tensor
from torchmetrics import Metric
from torchmetrics.classification import BinaryAUROC, MulticlassConfusionMatrix

from lightning_store import offload_to_cpu
from lightning_store._selfcheck._core import Context, Outcome, Skip
from lightning_store._selfcheck._cuda import _BlockedWaits, host_syncs, require_cuda
from lightning_store.metrics._reads import _queue_of
from lightning_store.metrics.offload import _Worker

BATCHES = 12  # of the CPU part
UPDATES = 20  # per Metric, counted on CUDA after the first (which checks the Metric once, with a host sync)
BATCH_SIZE = 64
FEATURES = 8
CLASSES = 5
THRESHOLDS = 200
CUDA_NEEDS = "the inputs' copies to the CPU without a host sync are CUDA's"


def _metrics() -> dict[str, Metric]:
    """A new pair, by name: a binned AUROC (a tensor state of counts) and a confusion matrix."""
    return {
        "BinaryAUROC": BinaryAUROC(thresholds=THRESHOLDS),
        "MulticlassConfusionMatrix": MulticlassConfusionMatrix(num_classes=CLASSES),
    }


def _inputs(name: str, logits: Tensor, target: Tensor) -> tuple[Tensor, Tensor]:
    """What the Metric ``name`` is fed from a batch's logits and class targets, on their device."""
    if name == "BinaryAUROC":
        return logits[:, 0].sigmoid(), (target == 0).long()
    return logits, target


class MetricHolder(torch.nn.Module):
    """A model-like module: a layer that makes the predictions, and the offloaded Metrics that it holds."""

    def __init__(self, worker: _Worker) -> None:
        super().__init__()
        self.net = torch.nn.Linear(FEATURES, CLASSES)
        self.metrics = torch.nn.ModuleDict({name: offload_to_cpu(m, worker=worker) for name, m in _metrics().items()})

    def predict(self, x: Tensor) -> Tensor:
        with torch.no_grad():
            logits: Tensor = self.net(x)
        return logits


def _held(metric: Metric) -> list[Tensor]:
    """Every tensor ``metric`` holds: its states (reading one waits for the updates queued), defaults and buffers."""
    held = list(metric.buffers())
    for name, default in metric._defaults.items():
        for value in (getattr(metric, name), default):
            held.extend(value if isinstance(value, list) else [value])
    return held


@dataclass
class OffloadRun:
    """What the offloaded Metrics of a :class:`MetricHolder` on one device gave, against the plain Metrics."""

    device: str
    updates: int  # per Metric
    same: dict[str, bool]  # the value, against the plain Metric on the CPU fed the inputs' CPU copies: bit for bit
    queued: dict[str, int]  # the updates that went through each Metric's queue
    state_devices: set[str] = field(default_factory=set)  # of every tensor held, and of the values
    metric_devices: set[str] = field(default_factory=set)  # `metric.device`
    device_bytes: int = 0  # the most held off the CPU at one look
    syncs: int | None = None  # host syncs in the updates after the first; None: not counted
    waits: int = 0  # updates that waited for the worker, `max_pending` updates being queued already
    device_diff: dict[str, float] = field(default_factory=dict)  # max |plain Metric on the device - offloaded|

    def look(self, metrics: dict[str, Metric]) -> None:
        """Record where the Metrics' tensors are, and how many bytes of them are off the CPU."""
        held = [t for metric in metrics.values() for t in _held(metric)]
        self.state_devices.update(t.device.type for t in held)
        self.metric_devices.update(metric.device.type for metric in metrics.values())
        self.device_bytes = max(self.device_bytes, sum(t.numel() * t.element_size() for t in held if not t.is_cpu))

    def problems(self) -> list[str]:
        found = [f"{name}'s value differs from the plain Metric's" for name, same in self.same.items() if not same]
        found += [
            f"{name}: {queued} of its {self.updates} updates went through its queue"
            for name, queued in self.queued.items()
            if queued != self.updates
        ]
        if self.state_devices != {"cpu"} or self.device_bytes:
            found.append(f"{self.device_bytes} bytes of state held on {sorted(self.state_devices - {'cpu'})}")
        if self.metric_devices != {"cpu"}:
            found.append(f"metric.device is {sorted(self.metric_devices)}, not cpu")
        if self.syncs:
            found.append(f"{self.syncs} host syncs in the {self.updates - 1} updates per Metric after the first")
        return found


def offload_run(device: torch.device, batches: int, count_syncs: bool, worker: _Worker = "process") -> OffloadRun:
    """Feed a :class:`MetricHolder` moved to ``device`` ``batches`` batches made there, then read its Metrics.

    The oracle is the plain Metric on the CPU fed the inputs' CPU copies, after the run; the same Metric on
    ``device``, fed the inputs themselves, gives the figure ``device_diff``.

    Args:
        device: where the module, its layer and the inputs are.
        batches: the updates of each Metric.
        count_syncs: count the host syncs in every update after the first (CUDA only).
        worker: ``offload_to_cpu``'s.
    """
    torch.manual_seed(0)  # the layer's weights
    holder = MetricHolder(worker)
    holder = holder.cuda(device) if device.type == "cuda" else holder.to(device)
    metrics = {name: cast(Metric, metric) for name, metric in holder.metrics.items()}
    run = OffloadRun(str(device), batches, same={}, queued={})
    run.look(metrics)
    generator = torch.Generator(device).manual_seed(0)
    fed: list[tuple[str, tuple[Tensor, Tensor]]] = []
    syncs = 0
    for step in range(batches):
        x = torch.randn(BATCH_SIZE, FEATURES, device=device, generator=generator)
        target = torch.randint(CLASSES, (BATCH_SIZE,), device=device, generator=generator)
        logits = holder.predict(x)
        for name, metric in metrics.items():
            inputs = _inputs(name, logits, target)
            fed.append((name, inputs))
            update = partial(metric.update, *inputs)
            if count_syncs and step:
                syncs += host_syncs(update, _BlockedWaits())  # not installed: the worker's waits are not this thread's
            else:
                update()
    run.syncs = syncs if count_syncs else None
    run.look(metrics)
    values = {name: metric.compute() for name, metric in metrics.items()}
    run.look(metrics)
    run.state_devices.update(value.device.type for value in values.values())
    plain = _metrics()
    on_device = {name: metric.to(device) for name, metric in _metrics().items()}
    for name, inputs in fed:
        plain[name].update(*(tensor.cpu() for tensor in inputs))
        on_device[name].update(*inputs)
    for name, value in values.items():
        want = plain[name].compute()
        run.same[name] = value.dtype == want.dtype and value.is_cpu and torch.equal(value.cpu(), want)
        run.device_diff[name] = _max_abs_diff(on_device[name].compute(), value)
        queue = _queue_of(metrics[name])
        run.queued[name] = queue.queued if queue is not None else 0
        run.waits += queue.waits if queue is not None else 0
    return run


def _max_abs_diff(a: Tensor, b: Tensor) -> float:
    return float((a.detach().cpu().double() - b.detach().cpu().double()).abs().max())


def offload_outcome(device: torch.device | None, skipped: str = "") -> Outcome:
    """The CPU part, then the part on ``device``: on CUDA, or none (``skipped`` says why).

    Args:
        device: the CUDA device of the second part (the CPU in the tests, where a fake counts the syncs), or None.
        skipped: why there is no second part, when ``device`` is None.
    """
    cpu = {worker: offload_run(torch.device("cpu"), BATCHES, False, worker) for worker in ("process", "thread")}
    problems = [
        f"on the CPU, worker={worker!r}: {problem}" for worker, run in cpu.items() for problem in run.problems()
    ]
    detail = (
        f"BinaryAUROC(thresholds={THRESHOLDS}) and MulticlassConfusionMatrix(num_classes={CLASSES}), {BATCHES}"
        " updates each on the CPU, in a worker process and in a worker thread, every one queued: values bit for bit"
        " those of the plain Metrics, every state on the CPU"
    )
    data: dict[str, Any] = {
        "cpu": asdict(cpu["process"]),
        "cpu_thread": asdict(cpu["thread"]),
        "cuda": None,
        "cuda_skipped": skipped or None,
    }
    if device is None:
        detail += f"; its CUDA part skipped ({skipped})"
    else:
        run = offload_run(device, UPDATES + 1, count_syncs=True)
        problems += [f"on {device}: {problem}" for problem in run.problems()]
        data["cuda"] = asdict(run)
        diffs = ", ".join(f"{diff:.3g} ({name})" for name, diff in run.device_diff.items())
        detail += (
            f"; on {device}, in a module moved with .cuda(): {run.syncs} host syncs in {UPDATES} updates each after"
            f" the first (update waited {run.waits} times for the worker), {run.device_bytes} bytes of state on"
            f" {device.type}, values bit for bit those of the plain Metrics on the CPU fed the inputs' CPU copies;"
            f" the plain Metrics run on {device.type} differ from them by at most {diffs}"
        )
    return Outcome("FAIL" if problems else "PASS", "; ".join(problems) or detail, data)


def check_offload(context: Context) -> Outcome:
    """Check 8: ``offload_to_cpu`` on the CPU, and on CUDA with no host sync; its CUDA part skipped elsewhere."""
    try:
        require_cuda(context, CUDA_NEEDS)
    except Skip as skip:
        return offload_outcome(None, str(skip))
    return offload_outcome(torch.device("cuda", torch.cuda.current_device()))
