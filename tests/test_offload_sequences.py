"""Random sequences of calls on an offloaded Metric and on the plain one, fed the same inputs: every value the same.

Each sequence mixes updates with the reads and changes a user makes between them (``compute``, ``forward``,
``reset``, ``state_dict`` and ``load_state_dict``, pickling, ``clone``, states read, counts, ``merge_state``), seeded,
for both workers; values are compared bit for bit (NaN included) at every read, and an update that raises in the
plain Metric raises at the offloaded one's next call, with the same type.
"""

import copy
import pickle
import random
from collections.abc import Callable
from typing import Any

import pytest
import torch
from _metrics import flatten, same_bytes
from torch import Tensor
from torchmetrics import CatMetric, MaxMetric, MeanMetric, Metric, MetricCollection, SumMetric
from torchmetrics.classification import (
    BinaryAUROC,
    MulticlassAccuracy,
    MulticlassConfusionMatrix,
    MulticlassF1Score,
    MulticlassPrecision,
)
from torchmetrics.regression import MeanSquaredError, PearsonCorrCoef
from torchmetrics.wrappers import ClasswiseWrapper, MinMaxMetric, Running

from lightning_store import offload_to_cpu

# torchmetrics' warning for a NaN it drops (`nan_strategy="warn"`; "Encounted" in older releases): the inputs hold
# NaNs on purpose, and the tests of the offloaded warnings hold it to its text and place
pytestmark = [
    pytest.mark.filterwarnings("ignore:Encount(er)?ed `nan` values in tensor:UserWarning"),
    pytest.mark.no_lightning,  # no Lightning here: not run again on each Lightning minor (.ci/run)
]

SEEDS, CALLS = range(3), 40

Inputs = tuple[tuple[Tensor, ...], dict[str, Any]]


def _values(rng: random.Random, generator: torch.Generator) -> Inputs:
    x = torch.randn(rng.choice([1, 3, 16]), generator=generator).to(rng.choice([torch.float32, torch.float64]))
    if rng.random() < 0.2:
        x[0] = float("nan")
    return (x * rng.choice([1.0, 1e6, 1e-6]),), {}


def _binary(rng: random.Random, generator: torch.Generator) -> Inputs:
    n = rng.choice([1, 3, 16, 64])
    return (torch.rand(n, generator=generator), torch.randint(0, 2, (n,), generator=generator)), {}


def _classes(rng: random.Random, generator: torch.Generator) -> Inputs:
    n = rng.choice([1, 3, 16, 64])
    return (torch.randn(n, 5, generator=generator).softmax(-1), torch.randint(0, 5, (n,), generator=generator)), {}


def _pairs(rng: random.Random, generator: torch.Generator) -> Inputs:
    x = torch.randn(rng.choice([2, 3, 16, 64]), generator=generator)
    return (x, x + 0.1 * torch.randn(x.shape, generator=generator)), {}


METRICS: dict[str, tuple[Callable[[], Any], Callable[[random.Random, torch.Generator], Inputs]]] = {
    "MeanMetric": (MeanMetric, _values),
    "SumMetric, NaN ignored": (lambda: SumMetric(nan_strategy="ignore"), _values),
    "CatMetric": (CatMetric, _values),
    "MaxMetric": (MaxMetric, _values),
    "MulticlassConfusionMatrix": (lambda: MulticlassConfusionMatrix(5), _classes),
    "BinaryAUROC, list states": (BinaryAUROC, _binary),
    "BinaryAUROC, binned": (lambda: BinaryAUROC(thresholds=11), _binary),
    "PearsonCorrCoef": (PearsonCorrCoef, _pairs),
    "a collection with compute groups": (
        lambda: MetricCollection(
            {"acc": MulticlassAccuracy(5), "prec": MulticlassPrecision(5), "f1": MulticlassF1Score(5, average=None)}
        ),
        _classes,
    ),
    "MinMaxMetric": (lambda: MinMaxMetric(MeanSquaredError()), _pairs),
    "ClasswiseWrapper": (lambda: ClasswiseWrapper(MulticlassAccuracy(5, average=None)), _classes),
    "Running": (lambda: Running(MeanMetric(), window=3), _values),
}

CALL_WEIGHTS = {
    "update": 30,
    "update, then its input changed in place": 5,
    "the same input twice": 2,
    "compute": 8,
    "forward": 5,
    "reset": 3,
    "state_dict": 4,
    "load_state_dict": 3,
    "states read": 4,
    "counts": 3,
    "merge_state": 2,
    "pickle": 2,
    "clone": 2,
    "deepcopy": 2,
}


def _outcome(call: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[str, Any]:
    try:
        return "returned", call(*args, **kwargs)
    except Exception as error:  # the plain Metric's errors are part of its behaviour
        return "raised", type(error).__name__


def _update(metric: Any, times: int, args: tuple, kwargs: dict) -> list[None]:
    return [metric.update(*args, **kwargs) for _ in range(times)]


def _assert_same(plain: Any, offloaded: Any, where: str) -> None:
    flat_plain, flat_offloaded = flatten(plain), flatten(offloaded)
    assert len(flat_plain) == len(flat_offloaded), where
    for a, b in zip(flat_plain, flat_offloaded, strict=True):
        assert same_bytes(b, a) if isinstance(a, Tensor) else a == b, f"{where}: {b!r}, plain {a!r}"


def _metrics_in(obj: Any) -> list[Metric]:
    return [module for module in obj.modules() if isinstance(module, Metric)]


def _run(name: str, worker: str, seed: int) -> None:
    make, inputs = METRICS[name]
    rng, generator = random.Random(seed), torch.Generator().manual_seed(seed)
    plain, offloaded = make(), offload_to_cpu(make(), worker=worker)
    saved: list[tuple[dict, dict]] = []
    calls: list[str] = []
    for _ in range(CALLS):
        call = rng.choices(list(CALL_WEIGHTS), weights=list(CALL_WEIGHTS.values()))[0]
        calls.append(call)
        where = f"{name}, worker={worker!r}, seed {seed}: {' / '.join(calls)}"
        if call.startswith("update") or call == "the same input twice":
            args, kwargs = inputs(rng, generator)
            copies = tuple(t.clone() for t in args)
            times = 2 if call == "the same input twice" else 1
            expected = _outcome(_update, plain, times, args, kwargs)
            got = _outcome(_update, offloaded, times, copies, kwargs)
            if call == "update, then its input changed in place":
                for tensor in copies:
                    tensor.zero_()
            if expected[0] == "raised":  # raised again at the offloaded Metric's next call, if not at this one
                later = got if got[0] == "raised" else _outcome(offloaded.compute)
                assert later == expected, where
                return
            assert got == ("returned", [None] * times), where
        elif call in ("compute", "forward"):
            args, kwargs = inputs(rng, generator)
            copies = tuple(t.clone() for t in args)
            if call == "compute":
                expected, got = _outcome(plain.compute), _outcome(offloaded.compute)
            else:
                expected, got = _outcome(plain, *args, **kwargs), _outcome(offloaded, *copies, **kwargs)
            assert got[0] == expected[0], f"{where}: {got}, plain {expected}"
            if expected[0] == "raised":
                assert got == expected, where
                if call == "forward":  # its update may have run before it raised: the states may differ
                    return
            else:
                _assert_same(expected[1], got[1], where)
        elif call == "reset":
            plain.reset()
            offloaded.reset()
        elif call == "state_dict":
            plain.persistent(True)
            offloaded.persistent(True)
            expected_state, got_state = plain.state_dict(), offloaded.state_dict()
            assert list(got_state) == list(expected_state), where
            _assert_same(dict(expected_state), dict(got_state), where)
            saved.append((copy.deepcopy(dict(expected_state)), copy.deepcopy(dict(got_state))))
        elif call == "load_state_dict" and saved:
            # a copy each time: the plain Metric's states become the tensors loaded, which its updates change in place
            expected_state, got_state = copy.deepcopy(rng.choice(saved))
            plain.load_state_dict(expected_state)
            offloaded.load_state_dict(got_state)
        elif call == "states read":
            for a, b in zip(_metrics_in(plain), _metrics_in(offloaded), strict=True):
                _assert_same([getattr(a, state) for state in a._defaults], [getattr(b, s) for s in b._defaults], where)
        elif call == "counts":
            for a, b in zip(_metrics_in(plain), _metrics_in(offloaded), strict=True):
                assert (b.update_count, b._computed is None) == (a.update_count, a._computed is None), where
        elif call == "merge_state" and hasattr(plain, "merge_state") and type(plain) in (MeanMetric, SumMetric):
            others = make(), make()
            args, kwargs = inputs(rng, generator)
            others[0].update(*args, **kwargs)
            others[1].update(*(t.clone() for t in args), **kwargs)
            assert _outcome(offloaded.merge_state, others[1]) == _outcome(plain.merge_state, others[0]), where
        elif call == "pickle":
            plain, offloaded = pickle.loads(pickle.dumps(plain)), pickle.loads(pickle.dumps(offloaded))
        elif call == "clone":
            plain, offloaded = plain.clone(), offloaded.clone()
        elif call == "deepcopy":
            plain, offloaded = copy.deepcopy(plain), copy.deepcopy(offloaded)
    expected, got = _outcome(plain.compute), _outcome(offloaded.compute)
    assert got[0] == expected[0], f"{name}, worker={worker!r}, seed {seed}: {' / '.join(calls)} / compute"
    if expected[0] == "returned":
        _assert_same(expected[1], got[1], f"{name}, worker={worker!r}, seed {seed}: {' / '.join(calls)} / compute")


@pytest.mark.parametrize("worker", ["thread", "process"])
@pytest.mark.parametrize("name", list(METRICS))
def test_a_random_sequence_of_calls_gives_the_plain_metrics_values(name, worker):
    for seed in SEEDS:
        _run(name, worker, seed)
