import pytest
import torch
from _support import REDUCTIONS, ManualTransfer, assert_same
from pytorch_lightning.trainer.connectors.logger_connector.result import _Metadata, _ResultMetric, _Sync

from lightning_store._logged import result as _result
from lightning_store._logged.result import _stored_on_cpu_class, _StoredOnCPU

VALUES = [(1.5, 4), (-2.25, 4), (float("nan"), 2), (7.0, 3), (0.125, 1)]


def _meta(reduce_fx="mean", on_step=True, on_epoch=True, collective=None, rank_zero_only=False):
    meta = _Metadata(fx="training_step", name="x", on_step=on_step, on_epoch=on_epoch, reduce_fx=reduce_fx)
    meta.sync = _Sync(_should=collective is not None, fn=collective, rank_zero_only=rank_zero_only)
    return meta


def _pair(meta, transfer=None, monkeypatch=None):
    """A plain ``_ResultMetric`` and a stored-on-CPU one, both updated once with the first value."""
    if transfer is not None:
        monkeypatch.setattr(_result, "_transfer_for", lambda device: transfer)
    plain, first = _ResultMetric(meta, True), _ResultMetric(meta, True)
    for result in (plain, first):
        result.forward(torch.tensor(VALUES[0][0]), VALUES[0][1])
    stored = _stored_on_cpu_class(_ResultMetric).adopt(first, torch.device("cpu"))
    return plain, stored


@pytest.mark.parametrize("reduce_fx", REDUCTIONS)
@pytest.mark.parametrize(("on_step", "on_epoch"), [(True, False), (False, True), (True, True)])
def test_every_value_matches_lightnings_result_metric(reduce_fx, on_step, on_epoch):
    plain, stored = _pair(_meta(reduce_fx, on_step, on_epoch))
    for value, batch_size in VALUES[1:]:
        for result in (plain, stored):
            result.forward(torch.tensor(value), batch_size)
        assert_same({"step": plain._forward_cache}, {"step": stored._forward_cache})
    assert_same({"value": plain.value}, {"value": stored.value})
    if on_epoch:
        assert_same({"epoch": plain.compute()}, {"epoch": stored.compute()})
    if reduce_fx == "mean" and on_epoch:
        assert_same({"n": plain.cumulated_batch_size}, {"n": stored.cumulated_batch_size})


def test_the_class_is_made_once_per_lightning_result_class():
    cls = _stored_on_cpu_class(_ResultMetric)
    assert cls is _stored_on_cpu_class(_ResultMetric)
    assert issubclass(cls, _StoredOnCPU) and issubclass(cls, _ResultMetric)


@pytest.mark.parametrize(
    "read",
    [
        lambda r: r._forward_cache,
        lambda r: r.compute(),
        lambda r: r.reset(),
        lambda r: r.to("cuda"),
        repr,
    ],
    ids=["step_value", "compute", "reset", "to", "repr"],
)
def test_every_read_first_completes_what_is_pending(read, monkeypatch):
    transfer = ManualTransfer()
    _, stored = _pair(_meta("sum"), transfer, monkeypatch)
    stored.forward(torch.tensor(2.0), 1)
    assert len(stored._buffer) == 3  # the state and step value handed over, then one copy for this call
    assert not any(copy.landed for copy in transfer.copies)
    read(stored)
    assert len(stored._buffer) == 0
    assert all(copy.waited and copy.released for copy in transfer.copies)


def test_values_read_after_landing_are_exact_and_outlive_the_reused_host_memory(monkeypatch):
    transfer = ManualTransfer()
    plain, stored = _pair(_meta("mean"), transfer, monkeypatch)
    for value, batch_size in VALUES[1:]:
        plain.forward(torch.tensor(value), batch_size)
        stored.forward(torch.tensor(value), batch_size)
    for copy in transfer.copies:
        copy.land()
    stored._buffer.fold_landed()
    # the folds kept no reference to host memory that `release` poisoned
    assert_same(
        {"epoch": plain.compute(), "step": plain._forward_cache},
        {"epoch": stored.compute(), "step": stored._forward_cache},
    )


def test_to_keeps_the_state_on_the_cpu():
    _, stored = _pair(_meta())
    assert stored.to("meta") is stored
    assert stored.value.device.type == "cpu" and stored.cumulated_batch_size.device.type == "cpu"


def test_reset_restores_cpu_defaults():
    _, stored = _pair(_meta("max"))
    stored.reset()
    assert stored.value.item() == float("-inf") and stored.value.device.type == "cpu"
    assert stored._forward_cache is None and stored.has_reset


def _two_identical_processes(tensor, reduce_op=None, group=None):
    """A collective as if a second process had logged the same values."""
    return tensor.mul_(2) if reduce_op in ("sum", "mean") else tensor


class _RefusingCollective:
    """Refuses tensors that did not come through the device round trip, as NCCL refuses CPU tensors.

    Reduces as if a second process had logged the same values (``sum``: doubles; ``max``/``min``: unchanged).
    """

    def __init__(self, monkeypatch):
        self.moved = []  # keeps the tensors alive, so their ids stay unique
        self.calls = 0
        move = _result._to_collective_device

        def marking_move(tensor, device):
            moved = move(tensor, device)
            self.moved.append(moved)
            return moved

        monkeypatch.setattr(_result, "_to_collective_device", marking_move)

    def __call__(self, tensor, reduce_op=None, group=None):
        if not any(tensor is moved for moved in self.moved):
            raise RuntimeError("Tensors must be CUDA and dense")
        self.calls += 1
        return _two_identical_processes(tensor, reduce_op, group)


@pytest.mark.parametrize("reduce_fx", REDUCTIONS)
def test_the_collective_only_ever_sees_tensors_moved_to_its_device(reduce_fx, monkeypatch):
    collective = _RefusingCollective(monkeypatch)
    plain = _ResultMetric(_meta(reduce_fx, collective=_two_identical_processes), True)
    first = _ResultMetric(_meta(reduce_fx, collective=_two_identical_processes), True)
    for result in (plain, first):
        result.forward(torch.tensor(VALUES[0][0]), VALUES[0][1])
    stored = _stored_on_cpu_class(_ResultMetric).adopt(first, torch.device("cpu"))
    stored.meta.sync = _Sync(_should=True, fn=collective)
    before = collective.calls
    for value, batch_size in VALUES[1:]:
        plain.forward(torch.tensor(value), batch_size)
        stored.forward(torch.tensor(value), batch_size)
        assert_same({"step": plain._forward_cache}, {"step": stored._forward_cache})
    assert_same({"epoch": plain.compute()}, {"epoch": stored.compute()})
    assert collective.calls == before + len(VALUES[1:]) + (2 if reduce_fx == "mean" else 1)
    assert stored._computed.device.type == "cpu"


def test_the_refusing_collective_catches_a_missing_round_trip(monkeypatch):
    """Lightning's own result hands its state straight to the collective: the check above would fail on it."""
    plain = _ResultMetric(_meta("sum", collective=_RefusingCollective(monkeypatch)), True)
    with pytest.raises(RuntimeError, match="Tensors must be CUDA and dense"):
        plain.forward(torch.tensor(1.0), 1)


def test_rank_zero_only_never_calls_the_collective(monkeypatch):
    collective = _RefusingCollective(monkeypatch)
    _, stored = _pair(_meta("sum", collective=None))
    stored.meta.sync = _Sync(_should=True, fn=collective, rank_zero_only=True)
    stored.forward(torch.tensor(3.0), 1)
    assert stored.compute().item() == 4.5 and collective.calls == 0
