"""Metrics a user writes with list states kept one element per item, and the wrappers torchmetrics ships, with data.

Shared by the tests and the 2-process worker (``_states_ddp_worker.py``): every maker returns a new unconfigured
Metric, so a test can compare the configured one with the plain one, fed the same data.
"""

import os
import random
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import Tensor
from torchmetrics import CatMetric, Metric, MetricCollection, SumMetric
from torchmetrics.classification import BinaryAUROC, BinaryAveragePrecision, MulticlassAUROC
from torchmetrics.regression import SpearmanCorrCoef
from torchmetrics.text import ROUGEScore
from torchmetrics.utilities.data import dim_zero_cat
from torchmetrics.wrappers import (
    BootStrapper,
    ClasswiseWrapper,
    MetricTracker,
    MinMaxMetric,
    MultioutputWrapper,
    MultitaskWrapper,
    Running,
)


class MeanOfSequenceMax(Metric):
    """The mean over sequences of each one's maximum: one element per sequence, of its own length."""

    full_state_update = False

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.add_state("sequences", default=[], dist_reduce_fx=None)

    def update(self, sequences: list[Tensor]) -> None:
        self.sequences.extend(sequences)

    def compute(self) -> Tensor:
        return torch.stack([s.max() for s in self.sequences]).mean()


class BoxesPerImage(Metric):
    """The mean number of boxes per image: one ``(n, 4)`` element per image, ``n`` may be 0."""

    full_state_update = False

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.add_state("boxes", default=[], dist_reduce_fx=None)

    def update(self, boxes: list[Tensor]) -> None:
        self.boxes.extend(boxes)

    def compute(self) -> Tensor:
        return torch.tensor([len(b) for b in self.boxes], dtype=torch.float32).mean()


class MatrixTraces(Metric):
    """Per-image matrices of different shapes (and their dtypes): a weighted sum, in order, of their means."""

    full_state_update = False

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.add_state("matrices", default=[], dist_reduce_fx=None)
        self.add_state("counts", default=[], dist_reduce_fx=None)
        self.add_state("flags", default=[], dist_reduce_fx=None)

    def update(self, matrices: list[Tensor]) -> None:
        for matrix in matrices:
            self.matrices.append(matrix)
            self.counts.append(torch.tensor(matrix.numel()))  # a 0-d int64 element
            self.flags.append(matrix > 0.5)  # a bool element

    def compute(self) -> Tensor:
        total = torch.zeros((), dtype=torch.float64)
        for i, (matrix, count, flags) in enumerate(zip(self.matrices, self.counts, self.flags, strict=True)):
            total = total * 0.5 + (i + 1) * matrix.double().mean() + count + flags.sum()
        return total


class Gram(Metric):
    """A user's Metric with a matmul in its update: autocast runs it in a lower precision."""

    full_state_update = False

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.add_state("gram", torch.zeros(4, 4), dist_reduce_fx="sum")

    def update(self, x: Tensor) -> None:
        self.gram += (x.T @ x).float()

    def compute(self) -> Tensor:
        return self.gram


class SeesLayout(Metric):
    """Keeps, at each update, the layout of its input and a sum over it (which adds in the order of its memory)."""

    def __init__(self):
        super().__init__()
        self.add_state("seen", [], dist_reduce_fx="cat")

    def update(self, x: Tensor) -> None:
        layout = [*x.shape, *x.stride(), x.data_ptr() % 64, x.is_contiguous()]
        layout.append(x.is_contiguous(memory_format=torch.channels_last) if x.dim() == 4 else -1)
        self.seen.append(torch.tensor(layout, dtype=torch.float64))
        self.seen.append(x.sum(dtype=torch.float32).reshape(1).double())

    def compute(self) -> Tensor:
        return dim_zero_cat(self.seen)


class SignedProduct(Metric):
    """A product from 0.0: an update by a negative number makes it -0.0, equal to its default and not the same bits."""

    def __init__(self):
        super().__init__()
        self.add_state("product", torch.tensor(0.0), dist_reduce_fx="sum")

    def update(self, x: Tensor) -> None:
        self.product = self.product * x

    def compute(self) -> Tensor:
        return self.product


class ChangesItsDefaults(Metric):
    """An update that adds a state at its first call (as a lazy Metric does), and may change a default in place."""

    def __init__(self, in_place: bool = False):
        super().__init__()
        self.in_place = in_place
        self.add_state("total", torch.zeros(3), dist_reduce_fx="sum")

    def update(self, x: Tensor) -> None:
        if "count" not in self._defaults:
            self.add_state("count", torch.tensor(0), dist_reduce_fx="sum")
        self.total += x
        self.count += 1
        if self.in_place:
            self._defaults["total"].add_(1.0)

    def compute(self) -> tuple[Tensor, Tensor]:
        return self.total, self.count


class SeesItsState(Metric):
    """Keeps, at each update, whether its state is an inference tensor (as ``reset()`` in inference mode makes it)."""

    def __init__(self):
        super().__init__()
        self.add_state("total", torch.zeros(2), dist_reduce_fx="sum")
        self.add_state("seen", [], dist_reduce_fx="cat")

    def update(self, x: Tensor) -> None:
        self.seen.append(torch.tensor([float(self.total.is_inference())]))
        self.total = self.total + x

    def compute(self) -> tuple[Tensor, Tensor]:
        return self.total, torch.cat(self.seen)


class NotMadeWhile(SumMetric):
    """A Metric that does not unpickle while the file ``path`` is there (as one whose class a process cannot import)."""

    def __init__(self, path: str):
        super().__init__()
        self.path = path

    def __setstate__(self, state: dict[str, Any]) -> None:
        if os.path.exists(state["path"]):
            raise ImportError(f"not made while {state['path']} is there")
        super().__setstate__(state)


class SlowSum(SumMetric):
    """A sum whose update takes ``seconds``: the worker process is still busy with it at the next call."""

    def __init__(self, seconds: float):
        super().__init__()
        self.seconds = seconds

    def update(self, value: Any) -> None:
        time.sleep(self.seconds)
        super().update(value)


def made_in_inference_mode(make: Callable[[], Tensor]) -> Tensor:
    """``make()`` run in inference mode: an inference tensor, as Lightning's evaluation loops make."""
    with torch.inference_mode():
        return make()


class SeesAll(Metric):
    """Keeps, at each update, what it can tell of its input: class, dtype, layout, alignment, mode and values."""

    def __init__(self):
        super().__init__()
        self.add_state("seen", [], dist_reduce_fx="cat")

    def update(self, x: Tensor) -> None:
        seen = [type(x).__name__, x.dtype, x.layout, tuple(x.shape), x.is_inference(), x.is_conj(), x.is_neg()]
        if x.layout == torch.strided:
            seen += [x.stride(), x.data_ptr() % 64 if x.numel() else 0]
        values = (x.to_dense() if x.layout != torch.strided else x).resolve_conj().resolve_neg()
        self.seen.append(torch.tensor(list(repr(seen).encode()), dtype=torch.uint8))
        self.seen.append(values.reshape(-1).clone().view(torch.uint8))

    def compute(self) -> list[Any]:
        """What each update saw: its description as text, then its values' bytes."""
        return [bytes(t).decode() if i % 2 == 0 else t for i, t in enumerate(self.seen)]


# a draw from each global generator an update may draw from
DRAWS: dict[str, Callable[[], float]] = {
    "torch's CPU": lambda: float(torch.rand(())),
    "Python's `random`": random.random,
    "NumPy's `np.random`": lambda: float(np.random.rand()),
}


class DrawsOnLargeBatches(SumMetric):
    """Adds a random number to batches of more than 4 values: the first, small batch draws nothing."""

    def __init__(self, generator: str):
        super().__init__()
        self.generator = generator

    def update(self, value: Tensor) -> None:
        if value.numel() > 4:
            value = value + DRAWS[self.generator]()
        super().update(value)


def _reverse(items: list[Tensor]) -> list[Tensor]:
    return items[::-1]


class LastSeenFirst(Metric):
    """A list state with a reduction of the user's, which gets the gathered elements as a list."""

    full_state_update = False

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.add_state("items", default=[], dist_reduce_fx=_reverse)

    def update(self, items: list[Tensor]) -> None:
        self.items.extend(items)

    def compute(self) -> Tensor:
        return torch.cat([item.reshape(-1) for item in self.items]) if self.items else torch.zeros(0)


class SizedItems(Metric):
    """A list state of Python objects next to one of tensors, gathered by a ``_sync_dist`` of its own (as
    ``MeanAveragePrecision`` gathers its segmentation masks): torchmetrics leaves the objects to it."""

    full_state_update = False

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.add_state("items", default=[], dist_reduce_fx=None)
        self.add_state("sizes", default=[], dist_reduce_fx=None)

    def update(self, items: list[Tensor]) -> None:
        for item in items:
            self.items.append(item)
            self.sizes.append((item.numel(), "item"))

    def _sync_dist(self, dist_sync_fn: Any = None, process_group: Any = None) -> None:
        super()._sync_dist(dist_sync_fn=dist_sync_fn, process_group=process_group)
        gathered: list[Any] = [None] * torch.distributed.get_world_size(process_group)
        torch.distributed.all_gather_object(gathered, self.sizes, group=process_group)
        self.sizes = [size for sizes in gathered for size in sizes]

    def compute(self) -> Tensor:
        mean_size = torch.tensor([size for size, _ in self.sizes], dtype=torch.float32).mean()
        return mean_size + torch.stack([item.sum() for item in self.items]).sum()


def sequences(seed: int, count: int, dtype: torch.dtype = torch.float32) -> list[Tensor]:
    """``count`` 1-d tensors of lengths 1 to 6."""
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 7, (count,), generator=generator).tolist()
    return [torch.rand(n, generator=generator).to(dtype) for n in lengths]


def boxes(seed: int, count: int) -> list[Tensor]:
    """``count`` ``(n, 4)`` tensors, ``n`` from 0 to 4."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.rand(int(n), 4, generator=generator) for n in torch.randint(0, 5, (count,), generator=generator)]


def matrices(seed: int, count: int) -> list[Tensor]:
    """``count`` 2-d tensors of shapes from 1x1 to 3x4, float32 or float64 in turn."""
    generator = torch.Generator().manual_seed(seed)
    out = []
    for i in range(count):
        rows, cols = (int(n) for n in torch.randint(1, 5, (2,), generator=generator))
        out.append(torch.rand(rows, cols, generator=generator, dtype=torch.float64 if i % 2 else torch.float32))
    return out


ELEMENT_METRICS: dict[str, tuple[Callable[[], Metric], Callable[[int, int], list[Tensor]]]] = {
    "sequence_max": (MeanOfSequenceMax, sequences),
    "boxes_per_image": (BoxesPerImage, boxes),
    "matrices": (MatrixTraces, matrices),
    "user_reduction": (LastSeenFirst, sequences),
}
# with the same number of elements on every process only: torchmetrics leaves its objects to its own `_sync_dist`
EQUAL_COUNT_METRICS = {**ELEMENT_METRICS, "objects_of_its_own": (SizedItems, sequences)}

SENTENCES = [
    ("the cat sat on the mat", "a cat sat on the mat"),
    ("there is a dog in the garden", "a dog is in the garden"),
    ("hello world", "hello there world"),
    ("lightning logs on the cpu", "lightning keeps logs on the cpu"),
]


def rouge() -> ROUGEScore:
    return ROUGEScore(rouge_keys=("rouge1", "rougeL"))


def binary_auroc() -> BinaryAUROC:
    return BinaryAUROC(thresholds=None)


def binary(seed: int, size: int) -> tuple[Tensor, Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return torch.rand(size, generator=generator), torch.randint(0, 2, (size,), generator=generator)


def _multitask_batch(seed: int, size: int) -> tuple[tuple[Any, ...], dict[str, Any]]:
    preds, target = binary(seed, size)
    return ({"auroc": preds, "both": preds}, {"auroc": target, "both": target}), {}


def _multiclass_batch(seed: int, size: int) -> tuple[tuple[Any, ...], dict[str, Any]]:
    generator = torch.Generator().manual_seed(seed)
    return (torch.rand(size, 3, generator=generator).softmax(-1), torch.arange(size) % 3), {}


def _two_outputs_batch(seed: int, size: int) -> tuple[tuple[Any, ...], dict[str, Any]]:
    generator = torch.Generator().manual_seed(seed)
    return (torch.rand(size, 2, generator=generator), torch.rand(size, 2, generator=generator)), {}


def _binary_batch(seed: int, size: int) -> tuple[tuple[Any, ...], dict[str, Any]]:
    return binary(seed, size), {}


def _cat_batch(seed: int, size: int) -> tuple[tuple[Any, ...], dict[str, Any]]:
    return (binary(seed, size)[0],), {}


WRAPPERS: dict[str, tuple[Callable[[], Any], Callable[[int, int], tuple[tuple[Any, ...], dict[str, Any]]]]] = {
    "BootStrapper": (lambda: BootStrapper(binary_auroc(), num_bootstraps=3), _binary_batch),
    "ClasswiseWrapper": (
        lambda: ClasswiseWrapper(MulticlassAUROC(num_classes=3, thresholds=None, average=None)),
        _multiclass_batch,
    ),
    "MultitaskWrapper": (
        lambda: MultitaskWrapper(
            {
                "auroc": binary_auroc(),
                "both": MetricCollection([binary_auroc(), BinaryAveragePrecision(thresholds=None)]),
            }
        ),
        _multitask_batch,
    ),
    "MetricTracker": (lambda: MetricTracker(binary_auroc()), _binary_batch),
    "MinMaxMetric": (lambda: MinMaxMetric(binary_auroc()), _binary_batch),
    "Running": (lambda: Running(CatMetric(), window=2), _cat_batch),
    "MultioutputWrapper": (lambda: MultioutputWrapper(SpearmanCorrCoef(), num_outputs=2), _two_outputs_batch),
    "CompositionalMetric": (lambda: binary_auroc() + BinaryAveragePrecision(thresholds=None), _binary_batch),
    "MetricCollection": (
        lambda: MetricCollection(
            {
                "auroc": MulticlassAUROC(num_classes=3, thresholds=None),
                "classwise": ClasswiseWrapper(MulticlassAUROC(num_classes=3, thresholds=None, average=None)),
            }
        ),
        _multiclass_batch,
    ),
}


try:  # the input transformers are not in torchmetrics 1.0
    from torchmetrics.wrappers import BinaryTargetTransformer, LambdaInputTransformer
except ImportError:
    pass
else:
    WRAPPERS["BinaryTargetTransformer"] = (
        lambda: BinaryTargetTransformer(binary_auroc(), threshold=0.5),
        lambda seed, size: (
            (binary(seed, size)[0], torch.rand(size, generator=torch.Generator().manual_seed(seed))),
            {},
        ),
    )
    WRAPPERS["LambdaInputTransformer"] = (
        lambda: LambdaInputTransformer(MetricCollection([binary_auroc()]), transform_pred=torch.sigmoid),
        _binary_batch,
    )


def run_wrapper(name: str, metric: Any, batches: list[tuple[int, int]]) -> list[Tensor]:
    """Feed ``metric`` (made by ``WRAPPERS[name]``) batches of ``(seed, size)``: ``forward`` on every second one,
    ``update`` on the others; return the tensors of every ``forward`` and of the final ``compute``.

    The global RNG is seeded before each batch (``BootStrapper`` samples from it). A ``MetricTracker`` starts a new
    Metric before the first batch and halfway, and ends with ``compute_all()``.
    """
    _, batch = WRAPPERS[name]
    out = []
    for index, (seed, size) in enumerate(batches):
        if name == "MetricTracker" and index in (0, len(batches) // 2):
            metric.increment()
        args, kwargs = batch(seed, size)
        torch.manual_seed(seed)
        if index % 2:
            out.extend(flatten(metric(*args, **kwargs)))
        else:
            metric.update(*args, **kwargs)
    return out + flatten(metric.compute_all() if name == "MetricTracker" else metric.compute())


def list_state_tensors(metric: Metric) -> list[Tensor]:
    """The tensors of every list state of ``metric``, state by state, in order."""
    return [t for attr, default in metric._defaults.items() if isinstance(default, list) for t in getattr(metric, attr)]


def flatten(value: Any) -> list[Tensor]:
    """The tensors of a result (a tensor, or dicts and lists of them, dict keys sorted), in order."""
    if isinstance(value, dict):
        return [t for key in sorted(value) for t in flatten(value[key])]
    if isinstance(value, list | tuple):
        return [t for item in value for t in flatten(item)]
    return [value]


def as_bytes(tensor: Tensor) -> Tensor:
    """The bytes of ``tensor``, flat: two tensors with equal bytes are equal bit for bit, NaN included."""
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8)


def same_bytes(got: Any, expected: Any) -> bool:
    """The same dtype, shape and bytes (bit for bit: NaN equal to the same NaN), for tensors and lists of them."""
    if isinstance(got, torch.Tensor):
        return (
            isinstance(expected, torch.Tensor)
            and got.dtype == expected.dtype
            and got.shape == expected.shape
            and torch.equal(as_bytes(got), as_bytes(expected))
        )
    if isinstance(got, str | type(None)) or isinstance(expected, str | type(None)):  # an error, or nothing
        return type(got) is type(expected) and got == expected
    return len(got) == len(expected) and all(same_bytes(g, e) for g, e in zip(got, expected, strict=True))


def assert_same_values(a: Any, b: Any) -> None:
    """The same tensors (dtype, device, values bit for bit) and the same other values, in the same structure."""
    flat_a, flat_b = flatten(a), flatten(b)
    assert len(flat_a) == len(flat_b)
    for x, y in zip(flat_a, flat_b, strict=True):
        if not isinstance(x, Tensor):
            assert type(x) is type(y) and x == y, (x, y)
            continue
        assert x.dtype == y.dtype and x.device == y.device and torch.equal(x, y), (x, y)


class SeesWaitPolicy(SumMetric):
    """Adds its input where ``OMP_WAIT_POLICY`` is ``PASSIVE`` in the process that updates it, subtracts it else."""

    def update(self, value: Tensor) -> None:
        super().update(value if os.environ.get("OMP_WAIT_POLICY") == "PASSIVE" else -value)
