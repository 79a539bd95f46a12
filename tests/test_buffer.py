import pytest
import torch
from _support import ManualTransfer

from lightning_store._buffer import _CopyBuffer, _Landed, _transfer_for


def _collector():
    folded = []
    return folded, lambda landed: folded.append(landed.item())


def test_without_a_transfer_values_are_folded_at_once():
    buffer = _CopyBuffer(None)
    folded, fold = _collector()
    buffer.put(torch.tensor(1.5), fold)
    assert folded == [1.5] and len(buffer) == 0


def test_nothing_is_folded_before_it_has_landed():
    transfer = ManualTransfer()
    buffer = _CopyBuffer(transfer)
    folded, fold = _collector()
    buffer.put(torch.tensor(1.0), fold)
    buffer.put(torch.tensor(2.0), fold)
    assert folded == [] and len(buffer) == 2
    buffer.fold_landed()
    assert folded == []


def test_folds_keep_the_order_of_the_puts():
    transfer = ManualTransfer()
    buffer = _CopyBuffer(transfer)
    folded, fold = _collector()
    for value in (1.0, 2.0, 3.0):
        buffer.put(torch.tensor(value), fold)
    transfer.copies[1].land()  # the second lands first: it waits for the first
    buffer.fold_landed()
    assert folded == []
    transfer.copies[0].land()
    buffer.fold_landed()
    assert folded == [1.0, 2.0] and len(buffer) == 1
    buffer.drain()
    assert folded == [1.0, 2.0, 3.0] and len(buffer) == 0


def test_put_folds_what_has_landed_since():
    transfer = ManualTransfer()
    buffer = _CopyBuffer(transfer)
    folded, fold = _collector()
    buffer.put(torch.tensor(1.0), fold)
    transfer.copies[0].land()
    buffer.put(torch.tensor(2.0), fold)
    assert folded == [1.0] and len(buffer) == 1


def test_drain_waits_for_every_copy_and_never_reads_a_half_copied_value():
    transfer = ManualTransfer()
    buffer = _CopyBuffer(transfer)
    folded, fold = _collector()
    for value in (4.0, 5.0):
        buffer.put(torch.tensor(value), fold)
    assert all(copy.host.isnan() for copy in transfer.copies)  # in flight: the host memory holds garbage
    buffer.drain()
    assert folded == [4.0, 5.0]
    assert all(copy.released for copy in transfer.copies)


def test_pending_copies_are_bounded():
    transfer = ManualTransfer()
    buffer = _CopyBuffer(transfer, max_pending=2)
    folded, fold = _collector()
    for value in (1.0, 2.0, 3.0, 4.0):
        buffer.put(torch.tensor(value), fold)
        assert len(buffer) <= 2
    assert folded == [1.0, 2.0]
    assert [copy.waited for copy in transfer.copies] == [True, True, False, False]


def test_a_failing_fold_still_releases_its_memory_and_leaves_the_rest_pending():
    transfer = ManualTransfer()
    buffer = _CopyBuffer(transfer)
    folded, fold = _collector()

    def broken(_):
        raise RuntimeError("fold failed")

    buffer.put(torch.tensor(1.0), broken)
    buffer.put(torch.tensor(2.0), fold)
    with pytest.raises(RuntimeError, match="fold failed"):
        buffer.drain()
    assert transfer.copies[0].released and len(buffer) == 1
    buffer.drain()
    assert folded == [2.0]


def test_a_value_from_another_device_is_copied_at_once_so_a_later_change_in_place_does_not_reach_its_fold():
    """A value not on the transfer's device is folded after the copies in flight before it: it needs its own copy."""
    value = torch.tensor([1.0, 2.0])
    landed = _Landed(value)
    value.mul_(10)
    assert landed.ready() and torch.equal(landed.wait(), torch.tensor([1.0, 2.0]))


def test_cpu_and_other_devices_get_no_transfer():
    assert _transfer_for(torch.device("cpu")) is None
    assert _transfer_for(torch.device("meta")) is None


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_transfer_lands_exact_values_in_pinned_memory_and_reuses_it():
    device = torch.device("cuda", torch.cuda.current_device())
    transfer = _transfer_for(device)
    assert transfer is _transfer_for(device)  # one copy stream and pool per device
    buffer = _CopyBuffer(transfer)
    folded = []
    hosts = []

    def fold(landed):
        assert landed.is_pinned() and landed.device.type == "cpu"
        hosts.append(landed.data_ptr())
        folded.append(landed.clone())

    values = [torch.randn((), device=device) * 1000 for _ in range(200)]
    for value in values:
        buffer.put(value * 3, fold)  # a temporary: its memory is reused unless the copy stream is recorded on it
    buffer.drain()
    assert torch.equal(torch.stack(folded), torch.stack([(v * 3).cpu() for v in values]))
    assert len(set(hosts)) < len(values)  # pinned memory was reused, not allocated per copy


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_a_value_changed_in_place_right_after_put_lands_as_it_was():
    """The copy and the change wait together behind a busy GPU, then start at once: the change must wait (issue 18)."""
    device = torch.device("cuda", torch.cuda.current_device())
    buffer = _CopyBuffer(_transfer_for(device))
    generator = torch.Generator(device).manual_seed(0)
    folded, expected = [], []
    for step in range(50):
        value = torch.randn(2**20, device=device, generator=generator)  # 4 MiB: a copy long enough to race
        expected.append(value.clone())
        torch.cuda._sleep(2_000_000)  # about a millisecond of GPU work queued before both
        buffer.put(value, lambda landed: folded.append(landed.clone()))
        if step % 2:
            value.mul_(-2)
        else:
            value.zero_()
    buffer.drain()
    assert len(folded) == 50
    assert all(torch.equal(got, want.cpu()) for got, want in zip(folded, expected, strict=True))
