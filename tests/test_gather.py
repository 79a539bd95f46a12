"""The collective layer's refusals, which come before any collective (the gathers themselves run on 2 processes in
``_metric_ddp_worker.py`` and ``_states_ddp_worker.py``: an in-process gloo group can deadlock when torch 2.3 frees
it, so none is made here)."""

import pytest
import torch

from lightning_store.metrics import _gather
from lightning_store.metrics._gather import _DTYPES, _gather_elements


def test_a_dtype_it_cannot_number_is_refused_with_the_dtypes_it_can(monkeypatch):
    monkeypatch.setattr(_gather, "_DTYPE_INDEX", {torch.float32: 0})
    with pytest.raises(TypeError, match=r"cannot gather tensors of dtype torch.int64. HINT: keep the state in one of"):
        _gather_elements([torch.arange(3)], None, chunk_bytes=64)


def test_more_than_eight_dimensions_are_refused_with_how_to_keep_the_state():
    with pytest.raises(ValueError, match=r"at most 8 dimensions, got 9. HINT: keep the state flatter, with `.reshape"):
        _gather_elements([torch.zeros([1] * 9)], None, chunk_bytes=64)


def test_every_dtype_torch_has_is_numbered():
    numbered = {torch.bool, torch.uint8, torch.int64, torch.float32, torch.float64, torch.complex128}
    assert numbered | {torch.uint16, torch.float8_e4m3fn, torch.complex32} <= set(_DTYPES)
    assert len(set(_DTYPES)) == len(_DTYPES)  # each its own number
