"""An offloaded update's inputs reach the Metric with the caller's layout: values and errors as the plain one's."""

import pickle
from collections import OrderedDict

import pytest
import torch
from _metrics import SeesAll, SeesLayout, assert_same_values, made_in_inference_mode
from torch import Tensor
from torchmetrics import CatMetric, MeanMetric, SumMetric

from lightning_store import offload_to_cpu
from lightning_store.metrics._offload import inputs as _inputs

pytestmark = pytest.mark.no_lightning  # no Lightning here: not run again on each Lightning minor (.ci/run)


def _randn(*shape: int, seed: int = 0) -> Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


LAYOUTS = {
    "contiguous": lambda: _randn(64, 33),
    "transposed": lambda: _randn(33, 64).T,
    "permuted": lambda: _randn(4, 5, 6).permute(2, 0, 1),
    "channels_last": lambda: _randn(2, 3, 8, 8).to(memory_format=torch.channels_last),
    "channels_last, sliced": lambda: _randn(2, 3, 8, 10).to(memory_format=torch.channels_last)[..., ::2],
    "every other column": lambda: _randn(40, 64)[:, ::2],
    "offset in its storage": lambda: _randn(41, 64)[1:, 3:],
    "one column": lambda: _randn(64, 33)[:, 5],
    "expanded": lambda: _randn(1, 64).expand(40, 64),
    "overlapping": lambda: torch.arange(100.0).as_strided((30, 8), (3, 1)),
    "a scalar": lambda: torch.tensor(2.5),
    "empty": lambda: _randn(0, 4),
    "a dim of one, with a stride of its own": lambda: _randn(40, 64).as_strided((40, 1, 64), (64, 999, 1)),
    "small, a dim of one with a stride of its own": lambda: _randn(2, 8).as_strided((2, 1, 8), (8, 99, 1)),
}


@pytest.mark.parametrize("worker", ["thread", "process"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_metric_sees_the_layout_the_caller_passed(layout, worker):
    plain, offloaded = SeesLayout(), offload_to_cpu(SeesLayout(), worker=worker)
    for _ in range(2):  # the second copy goes through a buffer the first handed back
        x = LAYOUTS[layout]()
        plain.update(x)
        offloaded.update(x)
    assert torch.equal(offloaded.compute(), plain.compute())


class Tagged(Tensor):
    """A tensor subclass, which a Metric may tell apart."""


def _complex(*shape: int) -> Tensor:
    return torch.complex(_randn(*shape, seed=1), _randn(*shape, seed=2))


KINDS = {
    "float32 scalar": lambda: torch.tensor(0.1),
    "bfloat16": lambda: torch.linspace(-1, 1, 7, dtype=torch.bfloat16),
    "bool": lambda: torch.tensor([True, False, True]),
    "int8, 2-D": lambda: torch.arange(-6, 6, dtype=torch.int8).reshape(3, 4),
    "empty": lambda: torch.empty(0, 3, dtype=torch.long),
    "conjugate view, small": lambda: _complex(4).conj(),
    "conjugate view, large": lambda: _complex(300, 40).conj(),
    "negative view, small": lambda: _complex(4).conj().imag,
    "negative view, large": lambda: _complex(300, 40).conj().imag,
    "made in inference mode, small": lambda: made_in_inference_mode(lambda: _randn(3)),
    "made in inference mode, large": lambda: made_in_inference_mode(lambda: _randn(300, 40)),
    "subclass, small": lambda: _randn(3).as_subclass(Tagged),
    "subclass, large": lambda: _randn(300, 40).as_subclass(Tagged),
    "sparse": lambda: torch.tensor([[0.0, 1.5], [2.5, 0.0]]).to_sparse(),
}


@pytest.mark.parametrize("worker", ["thread", "process"])
@pytest.mark.parametrize("kind", KINDS)
def test_the_update_sees_its_input_as_the_caller_passed_it(kind, worker):
    plain, offloaded = SeesAll(), offload_to_cpu(SeesAll(), worker=worker)
    if kind.startswith("subclass") and worker == "thread" and not _inputs._SUBCLASSES_UNDER_A_MODE:
        with pytest.raises(TypeError, match=r"tensor subclass Tagged with torch 2\.[0-3].*HINT: offload with"):
            offloaded.update(KINDS[kind]())
        return
    for _ in range(2):
        x = KINDS[kind]()
        plain.update(x)
        offloaded.update(x)
    assert_same_values(offloaded.compute(), plain.compute())


@pytest.mark.parametrize("worker", ["thread", "process"])
@pytest.mark.parametrize("shape", [(3,), (300, 40)], ids=["small", "large"])
def test_a_normal_tensor_passed_in_inference_mode_reaches_the_update_as_one(shape, worker):
    plain, offloaded = SeesAll(), offload_to_cpu(SeesAll(), worker=worker)
    x = _randn(*shape)
    with torch.inference_mode():  # Lightning's validation loop, on a tensor made before it
        for metric in (plain, offloaded):
            metric.update(x)
    assert_same_values(offloaded.compute(), plain.compute())


@pytest.mark.parametrize(("make", "x"), [(MeanMetric, _randn(3, 4000).T), (SumMetric, _randn(33, 500).T)])
def test_a_reduction_over_a_view_adds_as_the_plain_one(make, x):
    plain, offloaded = make(), offload_to_cpu(make(), worker="thread")
    plain.update(x)
    offloaded.update(x)
    assert torch.equal(offloaded.compute(), plain.compute())
    contiguous = make()
    contiguous.update(x.contiguous())
    assert not torch.equal(contiguous.compute(), plain.compute())  # the layout is what made them equal


class Flattens(SumMetric):
    def update(self, value: Tensor) -> None:
        super().update(value.view(-1))  # as `MeanSquaredError` does (torchmetrics >= 1.1): a transposed input fails


def test_an_input_the_plain_metric_rejects_for_its_layout_fails_every_update():
    x = _randn(3, 50).T
    with pytest.raises(RuntimeError, match="view size is not compatible") as plain_error:
        Flattens().update(x)
    metric = offload_to_cpu(Flattens(), worker="thread")
    for number in (1, 2):
        metric.update(x)
        with pytest.raises(RuntimeError, match=f"at update #{number} since offload_to_cpu") as err:
            metric.compute()
        assert str(err.value.__cause__) == str(plain_error.value)


def test_inputs_nested_in_collections_keep_their_layout():
    class Nested(SeesLayout):
        def update(self, items: list) -> None:
            for item in items:
                super().update(item["x"])

    plain, offloaded = Nested(), offload_to_cpu(Nested(), worker="thread")
    items = [{"x": LAYOUTS["transposed"]()}, {"x": LAYOUTS["every other column"]()}]
    plain.update(items)
    offloaded.update(items)
    assert torch.equal(offloaded.compute(), plain.compute())


def test_cpu_copies_go_through_buffers_reused_and_kept_for_the_latest_lengths_only(monkeypatch):
    monkeypatch.setattr(_inputs, "_host_pools", OrderedDict())  # none kept from other tests
    metric, plain = offload_to_cpu(CatMetric(), worker="thread"), CatMetric()
    size = _inputs._SMALL_BYTES // 4 + 1  # a small tensor is copied into memory of its own instead
    x = torch.arange(float(size))
    offset = x.data_ptr() % 64 // 4
    for _ in range(3):
        metric.update(x)
        plain.update(x.clone())
        metric.compute()  # landed: its buffer is back in the pool
        x.add_(1)
    assert len(_inputs._host_pools[(torch.float32, offset + size)]) == 1  # one buffer served the three copies
    for n in range(1, 3 * _inputs._POOL_SHAPES):  # inputs of varying shapes
        metric.update(torch.arange(float(size + n)))
        plain.update(torch.arange(float(size + n)))
    assert torch.equal(metric.compute(), plain.compute())
    assert len(_inputs._host_pools) == _inputs._POOL_SHAPES
    small = torch.arange(6.0)
    metric.update(small)
    plain.update(small)
    assert torch.equal(metric.compute(), plain.compute()) and len(_inputs._host_pools) == _inputs._POOL_SHAPES


def test_a_buffer_made_in_inference_mode_serves_a_copy_outside_it():
    metric, plain = offload_to_cpu(CatMetric(), worker="thread"), CatMetric()
    shape = (7, 3)  # a shape no other test uses: its buffer is made below, in inference mode
    with torch.inference_mode():  # Lightning's validation loop
        x = torch.rand(shape)
        metric.update(x)
        plain.update(x.clone())
        metric.compute()
    y = torch.rand(shape)  # then the training loop, the same shape
    metric.update(y)
    plain.update(y.clone())
    assert torch.equal(metric.compute(), plain.compute())


def _in_dtype(tensor: Tensor, dtype: torch.dtype) -> Tensor:
    """``tensor``'s layout (shape, strides, offset) over its storage's values in ``dtype``."""
    flat = torch.empty(0).set_(tensor.untyped_storage())
    flat = flat > 0 if dtype is torch.bool else flat.to(dtype)
    return flat.as_strided(tensor.shape, tensor.stride(), tensor.storage_offset())


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.complex64, torch.int64, torch.bool])
@pytest.mark.parametrize("inference", [False, True], ids=["normal", "inference"])
@pytest.mark.parametrize("read_in_inference_mode", [False, True], ids=["read outside", "read in inference mode"])
def test_a_state_sent_between_the_processes_comes_back_bit_for_bit(layout, dtype, inference, read_in_inference_mode):
    # what the worker process and this one send each other (a Metric's copy, its states back) pickles each tensor as
    # its bytes: the same values, dtype, shape, strides, and kind (inference or not), in memory of its own
    from lightning_store.metrics._offload.process import pickling

    with torch.inference_mode(inference):
        state = _in_dtype(LAYOUTS[layout](), dtype)
    payload = pickling.dumps([state, state])
    with torch.inference_mode(read_in_inference_mode):
        got, again = pickle.loads(payload)
    assert got is again  # one object pickled once, as pickle keeps it
    assert (got.dtype, got.shape, got.stride()) == (state.dtype, state.shape, state.stride())
    assert got.is_inference() == inference
    assert torch.equal(got, state)
    if state.numel():
        assert got.untyped_storage().data_ptr() != state.untyped_storage().data_ptr()


def test_bytes_that_are_not_the_span_of_their_layout_are_read_as_they_were_sent():
    # a tensor is made from its bytes in memory of the layout's span; bytes of another length (no sender here makes
    # them) are read as a tensor of their own, whose first elements the layout takes, not copied past its end
    from lightning_store.metrics._offload.process import pickling

    sent = torch.tensor([1.5, -2.0, 3.25], dtype=torch.float32)
    data = bytearray(sent.numpy().tobytes())
    got = pickling._tensor(data, torch.float32, (2,), (1,), False)
    assert torch.equal(got, sent[:2])
    assert pickling._tensor(bytes(data[:8]), torch.float32, (2,), (1,), False).tolist() == [1.5, -2.0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.bool])
@pytest.mark.parametrize("shape", [(), (3, 2)], ids=["scalars", "matrices"])
@pytest.mark.parametrize("inference", [False, True], ids=["normal", "inference"])
@pytest.mark.parametrize("read_in_inference_mode", [False, True], ids=["read outside", "read in inference mode"])
def test_a_long_list_state_comes_back_as_tensors_each_its_own(dtype, shape, inference, read_in_inference_mode):
    # a list state of many small tensors (ROUGE's scores, one per sentence) goes back as one block of their bytes
    from lightning_store.metrics._offload.process import pickling

    generator = torch.Generator().manual_seed(0)
    with torch.inference_mode(inference):
        state = [_in_dtype(torch.randn(shape, generator=generator) * 9, dtype) for _ in range(pickling._STACKED_FROM)]
        if dtype.is_floating_point:
            state[3] = torch.full(shape, float("nan"), dtype=dtype)
    sent = pickling.stacked(state)
    assert isinstance(sent, pickling._Stacked)
    with torch.inference_mode(read_in_inference_mode):
        got = pickle.loads(pickling.dumps({"scores": sent}))["scores"]
    assert type(got) is list and len(got) == len(state)
    for element, plain in zip(got, state, strict=True):
        assert (element.dtype, element.shape, element.stride()) == (plain.dtype, plain.shape, plain.stride())
        assert element.is_inference() == inference
        assert torch.equal(element.reshape(-1).view(torch.uint8), plain.reshape(-1).view(torch.uint8))  # a NaN's too
    storages = {element.untyped_storage().data_ptr() for element in got}
    assert len(storages) == len(state)  # each on memory of its own, as tensor by tensor


def test_a_list_state_that_is_short_shared_or_mixed_goes_tensor_by_tensor():
    from lightning_store.metrics._offload.process import pickling

    def scalars(count: int) -> list[Tensor]:
        return [torch.tensor(float(i)) for i in range(count)]

    assert type(pickling.stacked(scalars(pickling._STACKED_FROM - 1))) is list
    shared = scalars(pickling._STACKED_FROM)
    last = shared[-1]  # also an attribute of the Metric, say: one object, which pickle keeps one
    assert type(pickling.stacked(shared)) is list
    got = pickle.loads(pickling.dumps([shared, last]))
    assert got[0][-1] is got[1]
    del last
    assert type(pickling.stacked(shared)) is pickling._Stacked
    for mixed in (
        [*scalars(pickling._STACKED_FROM), torch.tensor(1)],  # another dtype
        [*scalars(pickling._STACKED_FROM), torch.ones(2)],  # another shape
        [*scalars(pickling._STACKED_FROM), torch.ones(4, 2).t()],  # not contiguous
        [*scalars(pickling._STACKED_FROM), 1.0],  # not a tensor
    ):
        assert type(pickling.stacked(mixed)) is list


@pytest.mark.filterwarnings("ignore:CatMetric. offloading it costs the step more")  # a cheap update
def test_a_metric_with_a_long_list_state_reads_as_the_plain_one():
    metric, plain = offload_to_cpu(CatMetric()), CatMetric()
    for value in range(300):
        metric.update(torch.tensor(value / 7))
        plain.update(torch.tensor(value / 7))
    assert len(metric.value) == len(plain.value) == 300
    assert all(torch.equal(a, b) for a, b in zip(metric.value, plain.value, strict=True))
    assert torch.equal(metric.compute(), plain.compute())
