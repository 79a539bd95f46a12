"""The shared arena for a worker process's inputs: a ring of spans, taken at the head and given back in order."""

import errno
import os
from multiprocessing import shared_memory

import pytest
import torch

from lightning_store.metrics._offload.layout import ALIGNMENT
from lightning_store.metrics._offload.process import arena as arena_module
from lightning_store.metrics._offload.process.arena import _Arena, _Space

pytestmark = pytest.mark.no_lightning  # no Lightning here: not run again on each Lightning minor (.ci/run)


def test_spans_are_taken_in_order_wrap_around_and_wait_when_full():
    arena = _Arena(1024)
    try:
        assert [arena.take(300), arena.take(300), arena.take(300)] == [0, 320, 640]  # 64-byte aligned
        assert arena.take(200) is None  # 960 + 256 > 1024, and the front is still taken
        arena.give_back()  # the oldest, [0, 320), is free again
        assert arena.take(200) == 0  # wrapped around
        assert arena.take(100) is None  # wrapped: only [256, 320) is free
        assert arena.take(64) == 256
        for _ in range(4):
            arena.give_back()
        assert not arena.spans and arena.take(1000) == 0  # empty: from the start again
    finally:
        arena.close(unlink=True)


def test_a_tensor_written_at_an_offset_reads_back():
    arena = _Arena(4096)
    try:
        offset = arena.take(40)
        arena.tensor(offset, torch.float32, 10).copy_(torch.arange(10.0))
        assert offset % ALIGNMENT == 0
        assert torch.equal(arena.tensor(offset, torch.float32, 10), torch.arange(10.0))
        assert arena.tensor(offset, torch.float32, 0).numel() == 0
    finally:
        arena.close(unlink=True)


def test_a_new_arena_is_not_named_as_one_the_worker_process_holds_though_its_name_was_removed(monkeypatch):
    space = _Space(forget=lambda arena: arena.close(unlink=True))
    try:
        first, _ = space.take(1024, wait=lambda: None)
        space.sent(first)
        space.opened(first.name)  # the worker process opened it: its name is removed, and may come again
        assert first.unlinked and not os.path.exists(os.path.join("/dev/shm", first.name))
        names = iter([f"/{first.name}", "/psm_lightning_store_test"])
        monkeypatch.setattr(shared_memory, "_make_filename", lambda: next(names))
        second, offset = space.take(first.size, wait=lambda: None)  # larger than half of it: a new arena
        assert (second.name, offset) == ("psm_lightning_store_test", 0)
        assert not second.unlinked  # not opened there yet: named until it is
    finally:
        space.close()


def test_an_arena_whose_room_cannot_be_reserved_for_want_of_a_file_descriptor_leaves_nothing_in_dev_shm(monkeypatch):
    made: list[str] = []
    created = shared_memory.SharedMemory

    def recorded(*args, **kwargs):
        segment = created(*args, **kwargs)
        made.append(segment.name)
        return segment

    real_open = os.open

    def no_descriptor_left(path, flags, *args, **kwargs):  # for the segment's file alone: os.open is everyone's
        if str(path).startswith("/dev/shm/"):
            raise OSError(errno.EMFILE, "Too many open files", path)
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(arena_module.shared_memory, "SharedMemory", recorded)
    monkeypatch.setattr(arena_module.os, "open", no_descriptor_left)
    with pytest.raises(RuntimeError, match=r"a segment of 4\.0 KiB for them could not be made \(OSError") as raised:
        _Arena(4096)
    assert isinstance(raised.value.__cause__, OSError) and raised.value.__cause__.errno == errno.EMFILE
    assert len(made) == 1
    assert not os.path.exists(os.path.join("/dev/shm", made[0].lstrip("/")))
