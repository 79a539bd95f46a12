"""The collective layer: ``gather_on_device`` and the gather of a list of elements, in one process (the 2-process
runs are in ``_metric_ddp_worker.py`` and ``_states_ddp_worker.py``)."""

import pytest
import torch

from lightning_store import gather_on_device
from lightning_store._gather import _DTYPES, _gather_elements


@pytest.fixture
def one_process_group(tmp_path):
    torch.distributed.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield torch.distributed.group.WORLD
    torch.distributed.destroy_process_group()


def test_a_dtype_it_cannot_number_is_refused_with_the_dtypes_it_can(one_process_group, monkeypatch):
    from lightning_store import _gather

    monkeypatch.setattr(_gather, "_DTYPE_INDEX", {torch.float32: 0})
    with pytest.raises(TypeError, match=r"cannot gather tensors of dtype torch.int64. HINT: keep the state in one of"):
        _gather_elements([torch.arange(3)], one_process_group, chunk_bytes=64)


def test_more_than_eight_dimensions_are_refused_with_how_to_keep_the_state(one_process_group):
    with pytest.raises(ValueError, match=r"at most 8 dimensions, got 9. HINT: keep the state flatter, with `.reshape"):
        gather_on_device(torch.zeros([1] * 9))


def test_every_dtype_is_numbered_and_elements_of_this_process_come_back_as_they_are(one_process_group):
    elements = [torch.zeros(2, 3).to(dtype) for dtype in _DTYPES]
    (gathered,) = _gather_elements(elements, one_process_group, chunk_bytes=8)
    assert all(g is e for g, e in zip(gathered, elements, strict=True))
    assert {torch.uint16, torch.float8_e4m3fn, torch.complex32} <= set(_DTYPES)


def test_a_process_alone_gathers_its_own_tensor(one_process_group):
    (gathered,) = gather_on_device(torch.arange(5.0), chunk_bytes=8)
    assert torch.equal(gathered, torch.arange(5.0))
