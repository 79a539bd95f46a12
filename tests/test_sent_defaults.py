"""A worker process's copy sent again after a read: defaults it holds, and states equal to them, go as references."""

import pytest
import torch
from _metrics import ChangesItsDefaults, NotMadeWhile, SeesItsState, SignedProduct, assert_same_values, same_bytes
from torchmetrics import MetricCollection
from torchmetrics.classification import BinaryAUROC, MulticlassConfusionMatrix, MulticlassPrecision, MulticlassRecall

from lightning_store import offload_to_cpu
from lightning_store.metrics._offload.process import parent
from lightning_store.metrics._offload.process.parent import _process_worker

pytestmark = pytest.mark.no_lightning  # no Lightning here: not run again on each Lightning minor (.ci/run)


@pytest.fixture
def copies_sent(monkeypatch):
    """The size in bytes of each copy of an object sent to the worker process."""
    sizes: list[int] = []
    send = parent._ProcessWorker.send

    def counted(self, message, start=False):
        if type(message).__name__ == "_Replace":
            sizes.append(len(message.payload))
        return send(self, message, start)

    monkeypatch.setattr(parent._ProcessWorker, "send", counted)
    return sizes


def _classes(seed, size=2000, classes=300):
    generator = torch.Generator().manual_seed(seed)
    return tuple(torch.randint(0, classes, (size,), generator=generator) for _ in range(2))


def test_a_large_state_after_compute_and_reset_is_sent_again_in_a_few_kilobytes(copies_sent):
    metric, plain = offload_to_cpu(MulticlassConfusionMatrix(300), worker="process"), MulticlassConfusionMatrix(300)
    for epoch in range(3):
        for step in range(3):
            batch = _classes(10 * epoch + step)
            metric.update(*batch)
            plain.update(*batch)
        assert_same_values(metric.compute(), plain.compute())
        metric.reset()
        plain.reset()
    state_bytes = 300 * 300 * 8  # the state, and its default as much
    assert len(copies_sent) == 3
    assert copies_sent[0] > 2 * state_bytes
    assert all(size < 20_000 for size in copies_sent[1:]), copies_sent


def test_a_state_read_without_a_reset_is_sent_as_it_is(copies_sent):
    metric, plain = offload_to_cpu(MulticlassConfusionMatrix(300), worker="process"), MulticlassConfusionMatrix(300)
    for step in range(3):
        batch = _classes(step)
        metric.update(*batch)
        plain.update(*batch)
        assert_same_values(metric.confmat, plain.confmat)  # a read (not `compute()`, whose value is kept besides)
    state_bytes = 300 * 300 * 8
    assert len(copies_sent) == 3
    # after a read, the state differs from its default: its bytes go; the default goes as a reference
    assert all(state_bytes < size < 2 * state_bytes for size in copies_sent[1:]), copies_sent


def test_a_state_equal_to_its_default_in_value_but_not_in_bits_is_sent_as_its_bits():
    metric, plain = offload_to_cpu(SignedProduct(), worker="process"), SignedProduct()
    for value in (-1.0, 1.0, 2.0):  # 0.0 * -1 is -0.0, which equals the default 0.0; read between the updates
        metric.update(torch.tensor(value))
        plain.update(torch.tensor(value))
        got, expected = metric.compute(), plain.compute()
        assert same_bytes(got, expected) and torch.signbit(got)


def test_a_default_changed_here_since_it_was_sent_is_sent_again():
    make = lambda: MetricCollection([MulticlassPrecision(10), MulticlassRecall(10)])  # noqa: E731
    metric, plain = offload_to_cpu(make(), worker="process"), make()
    for epoch in range(3):
        batch = _classes(epoch, size=200, classes=10)
        metric.update(*batch)
        plain.update(*batch)
        assert_same_values(metric.compute(), plain.compute())
        for collection in (metric, plain):
            for member in collection.values():
                member._defaults["tp"].fill_(epoch + 1)  # in place: the same tensor, a new version
            collection.reset()
    batch = _classes(9, size=200, classes=10)
    metric.update(*batch)
    plain.update(*batch)
    assert_same_values(metric.compute(), plain.compute())


@pytest.mark.parametrize("in_place", [False, True], ids=["a state added", "and a default changed in place"])
def test_a_default_an_update_added_or_changed_in_the_worker_process_comes_back_with_the_states(in_place):
    metric, plain = offload_to_cpu(ChangesItsDefaults(in_place), worker="process"), ChangesItsDefaults(in_place)
    for epoch in range(3):
        for step in range(2):
            x = torch.full((3,), float(10 * epoch + step))
            metric.update(x)
            plain.update(x)
        assert_same_values(metric.compute(), plain.compute())
        assert_same_values(dict(metric._defaults), dict(plain._defaults))
        assert sorted(metric._persistent) == sorted(plain._persistent) == ["count", "total"]
        metric.reset()
        plain.reset()
        assert_same_values((metric.total, metric.count), (plain.total, plain.count))


def test_a_state_reset_in_inference_mode_reaches_the_worker_process_as_an_inference_tensor():
    metric, plain = offload_to_cpu(SeesItsState(), worker="process"), SeesItsState()
    seen = []
    for epoch in range(3):
        x = torch.full((2,), float(epoch))
        metric.update(x)
        plain.update(x)
        got = metric.compute()
        assert_same_values(got, plain.compute())
        seen.append(float(got[1]))
        with torch.inference_mode(epoch % 2 == 0):
            metric.reset()
            plain.reset()
    assert seen == [0.0, 1.0, 0.0]  # the update after a reset in inference mode saw an inference tensor


def test_a_new_worker_process_gets_the_whole_object(copies_sent):
    metric, plain = offload_to_cpu(BinaryAUROC(thresholds=50), worker="process"), BinaryAUROC(thresholds=50)
    generator = torch.Generator().manual_seed(0)
    batches = [(torch.rand(100, generator=generator), torch.randint(0, 2, (100,), generator=generator))] * 3
    for batch in batches[:2]:
        metric.update(*batch)
        plain.update(*batch)
    assert_same_values(metric.compute(), plain.compute())
    metric.reset()
    plain.reset()
    _process_worker().process.kill()  # holds the defaults: a new one does not
    _process_worker().process.join(10)
    metric.update(*batches[2])
    plain.update(*batches[2])
    assert_same_values(metric.compute(), plain.compute())
    assert copies_sent[-1] >= copies_sent[0] > 0  # the whole object, as at first


def test_a_copy_the_worker_process_could_not_make_is_sent_whole_once_it_can(tmp_path):
    path = tmp_path / "not yet"
    path.touch()
    metric, plain = offload_to_cpu(NotMadeWhile(str(path)), worker="process"), NotMadeWhile(str(path))
    metric.update(torch.tensor(1.0))
    with pytest.raises(RuntimeError, match="could not make its copy of it"):
        metric.compute()
    path.unlink()
    metric.reset()  # as the error says: it holds nothing the worker process could take from its copy
    for m in (metric, plain):
        m.update(torch.tensor(2.0))
    assert_same_values(metric.compute(), plain.compute())
