"""Run by tests/test_distributed.py as 2 processes on gloo: each rank writes what its offloaded Metrics gave.

Each check compares a Metric given to ``offload_to_cpu`` with the same Metric unconfigured on the CPU, fed the same
data: synced by torchmetrics on the same 2 processes where it can sync, else in one process fed every rank's
elements in the order documented for ``_sync_dist`` (element by element, in rank order). Then, in the same process
group, a Lightning fit of a module holding an offloaded ``BinaryAUROC`` and of the same module holding a plain one.

Usage: RANK=r LOCAL_RANK=r WORLD_SIZE=2 MASTER_ADDR=... MASTER_PORT=... [OFFLOAD_WORKER=process]
python tests/_offload_ddp_worker.py OUT_DIR
"""

import os
import sys
import time
import warnings
from datetime import timedelta
from pathlib import Path

import pytorch_lightning as pl
import torch
import torch.distributed as dist
from _metrics import ELEMENT_METRICS, WRAPPERS, MeanOfSequenceMax, binary, flatten, run_wrapper, same_bytes
from _support import finish_rank
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics import MeanMetric, MetricCollection
from torchmetrics.classification import (
    BinaryAccuracy,
    BinaryAUROC,
    BinaryPrecision,
    BinaryRecall,
    MulticlassConfusionMatrix,
)

from lightning_store import offload_to_cpu
from lightning_store.metrics._reads import _is_offloaded, _queue_of

SLOW_S = 0.01  # how long a slow update takes, on the rank that is slow
WORKER = os.environ.get("OFFLOAD_WORKER", "thread")  # the worker every Metric here is offloaded to


def _labels(seed, size):
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 3, (size,), generator=generator), torch.randint(0, 3, (size,), generator=generator)


def _weighted(seed, size):
    generator = torch.Generator().manual_seed(seed)
    return torch.rand(size, generator=generator) * 10, torch.rand(size, generator=generator)


# list states joined by `dim_zero_cat`, and tensor states: torchmetrics syncs them whatever the update counts
TENSOR_METRICS = {
    "auroc": (lambda **kwargs: BinaryAUROC(thresholds=None, **kwargs), binary),
    "confusion_matrix": (lambda **kwargs: MulticlassConfusionMatrix(num_classes=3, **kwargs), _labels),
    "mean": (MeanMetric, _weighted),
}


class SlowAUROC(BinaryAUROC):
    """A ``BinaryAUROC`` whose update takes ``delay`` seconds: its queue is still full when ``compute`` is called."""

    def __init__(self, delay: float) -> None:
        super().__init__(thresholds=None)
        self.delay = delay

    def update(self, preds, target):
        time.sleep(self.delay)
        super().update(preds, target)


class SlowSequenceMax(MeanOfSequenceMax):
    """A list state kept one element per item, whose update takes ``delay`` seconds."""

    def __init__(self, delay: float) -> None:
        super().__init__()
        self.delay = delay

    def update(self, sequences):
        time.sleep(self.delay)
        super().update(sequences)


def _plain(value):
    if isinstance(value, torch.Tensor):
        return {"dtype": str(value.dtype), "shape": list(value.shape), "values": value.tolist()}
    if isinstance(value, str | type(None)):
        return value
    return [_plain(v) for v in value]


def _record(got, expected, *, synced=True, **flags):
    """Whether ``got`` is ``expected`` and every flag true; ``synced``: whether ``got`` is the same on every rank."""
    ok = same_bytes(got, expected) and all(flags.values())
    return {"ok": ok, "got": _plain(got), "expected": _plain(expected), "synced": synced}


def _interleave(by_rank):
    """The order of ``_sync_dist``: the first element of every rank in rank order, then the second..."""
    longest = max(map(len, by_rank))
    return [elements[i] for i in range(longest) for elements in by_rank if i < len(elements)]


def _quiet(fn, *args, **kwargs):
    """``fn(...)``, or its error as ``"TypeName: message"``; the warning of a compute before any update ignored."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            return fn(*args, **kwargs)
        except Exception as err:
            return f"{type(err).__name__}: {err}"


def _states(metric):
    """Every state of ``metric``, in order: a tensor, or the elements of a list."""
    out = []
    for attr in metric._defaults:
        state = getattr(metric, attr)
        out.extend(state if isinstance(state, list) else [state])
    return out


def _batches(data, rank, count, first=0):
    """``count`` batches of rank ``rank``, of sizes that differ across ranks and batches."""
    return [data(1000 * (rank + 1) + i, 3 + 2 * rank + i) for i in range(first, first + count)]


def _single(make, batches_by_rank):
    """The plain Metric in one process, fed every rank's batches in rank order (where the cat is in rank order)."""
    metric = make(sync_on_compute=False)
    for batches in batches_by_rank:
        for batch in batches:
            metric.update(*batch)
    return _quiet(metric.compute)


def _ordered(name, counts, per_update=2):
    """The plain Metric of ``ELEMENT_METRICS[name]`` in one process, fed every rank's elements in the order of
    ``_sync_dist``; and the batches of each rank (``counts[r]`` updates of ``per_update`` elements)."""
    make, elements = ELEMENT_METRICS[name]
    by_rank = [[elements(1000 * (r + 1) + i, per_update) for i in range(count)] for r, count in enumerate(counts)]
    ordered = _interleave([[e for batch in batches for e in batch] for batches in by_rank])
    single = make(sync_on_compute=False)  # one process: no collective to run
    reduction = next(iter(single._reductions.values()))  # the user's reduction gets the ordered elements
    single.update(reduction(ordered) if reduction is not None else ordered)
    return single.compute(), by_rank


def _compute_equals_plain(rank):
    """Scenario 1: the same number of updates on every rank, compute on both."""
    checks = {}
    for name, (make, data) in TENSOR_METRICS.items():
        offloaded, plain = offload_to_cpu(make(), worker=WORKER), make()
        for batch in _batches(data, rank, 3):
            offloaded.update(*batch)
            plain.update(*batch)
        checks[name] = _record([offloaded.compute()], [plain.compute()], offloaded=_is_offloaded(offloaded))
        # after the sync, each rank's own states are back, as torchmetrics leaves them
        checks[f"{name}_local_state"] = _record(_states(offloaded), _states(plain), synced=False)
        checks[f"{name}_again"] = _record([offloaded.compute()], [plain.compute()])  # the value computed, kept
    return checks


def _uneven(rank, world):
    """Scenario 2: 3 updates on rank 0 and 1 on rank 1; none on rank 0 and 2 on rank 1."""
    checks = {}
    for counts in ((3, 1), (0, 2)):
        suffix = f"{counts[0]}_{counts[1]}"
        for name, (make, data) in TENSOR_METRICS.items():
            offloaded, plain = offload_to_cpu(make(), worker=WORKER), make()
            for batch in _batches(data, rank, counts[rank]):
                offloaded.update(*batch)
                plain.update(*batch)
            got = _quiet(offloaded.compute)
            if name == "auroc":  # `dim_zero_cat` joins the ranks' elements in rank order
                single = _single(make, [_batches(data, r, counts[r]) for r in range(world)])
                checks[f"{name}_{suffix}_single"] = _record([got], [single])
            if name != "auroc" or all(counts):  # torchmetrics fails to sync an empty list (a float32 target)
                checks[f"{name}_{suffix}"] = _record([got], [_quiet(plain.compute)])
        # plain torchmetrics gathers these element by element, which needs the same count on every rank
        for name, (make, _) in ELEMENT_METRICS.items():
            offloaded = offload_to_cpu(make(), worker=WORKER)
            expected, by_rank = _ordered(name, counts)
            for batch in by_rank[rank]:
                offloaded.update(batch)
            checks[f"{name}_{suffix}"] = _record([_quiet(offloaded.compute)], [expected])
    return checks


def _sync_on_step(rank):
    """Scenario 3: ``dist_sync_on_step=True``, ``forward`` after queued updates: each batch value as plain."""
    makers = {name: (make, data) for name, (make, data) in TENSOR_METRICS.items() if name != "confusion_matrix"}
    for name, (make, elements) in ELEMENT_METRICS.items():  # the same count on every rank: torchmetrics syncs them
        makers[name] = (make, lambda seed, size, elements=elements: (elements(seed, 2),))
    checks = {}
    for name, (make, data) in makers.items():
        offloaded, plain = offload_to_cpu(make(dist_sync_on_step=True), worker=WORKER), make(dist_sync_on_step=True)
        got, expected = [], []
        for step, batch in enumerate(_batches(data, rank, 5)):
            if step % 2:
                got.append(offloaded(*batch))
                expected.append(plain(*batch))
            else:
                offloaded.update(*batch)
                plain.update(*batch)
        checks[name] = _record([*got, offloaded.compute()], [*expected, plain.compute()])
    return checks


def _collection_and_wrappers(rank):
    """Scenario 4: a collection with a compute group, and every wrapper but ``BootStrapper`` (refused)."""

    def collection():
        return MetricCollection([BinaryAccuracy(), BinaryPrecision(), BinaryRecall()])

    checks = {}
    offloaded, plain = offload_to_cpu(collection(), worker=WORKER), collection()
    got, expected = [], []
    for step, batch in enumerate(_batches(binary, rank, 4)):
        if step == 2:
            got.extend(flatten(offloaded(*batch)))
            expected.extend(flatten(plain(*batch)))
        else:
            offloaded.update(*batch)
            plain.update(*batch)
    computed, plain_computed = offloaded.compute(), plain.compute()
    checks["collection_forward"] = _record(got, expected, synced=False)  # the batch's value, not synced
    checks["collection"] = _record(
        flatten(computed),
        flatten(plain_computed),
        same_keys=sorted(computed) == sorted(plain_computed),
        same_groups=offloaded.compute_groups == plain.compute_groups and len(plain.compute_groups) == 1,
    )
    batches = [(100 * rank + i, 4 + rank + i) for i in range(4)]
    for name, (make, _) in WRAPPERS.items():
        if name == "BootStrapper":
            continue
        got, expected = (
            _quiet(run_wrapper, name, offload_to_cpu(make(), worker=WORKER), batches),
            _quiet(run_wrapper, name, make(), batches),
        )
        checks[f"wrapper_{name}"] = _record(got, expected, synced=False)  # with values of `forward`
    return checks


def _many_queued(rank):
    """Scenario 5: ``max_pending=2``, 20 slow updates right before ``compute``: the queue settles before the
    collective on every rank (the slow rank reaches it last, the other waits for it there)."""
    checks = {}
    delay = SLOW_S if rank == 0 else 0.0
    offloaded, plain = offload_to_cpu(SlowAUROC(delay), max_pending=2, worker=WORKER), BinaryAUROC(thresholds=None)
    for batch in _batches(binary, rank, 20):
        offloaded.update(*batch)
        plain.update(*batch)
    queue = _queue_of(offloaded)
    pending, waits = queue.pending, queue.waits
    checks["auroc"] = _record([offloaded.compute()], [plain.compute()], settled=queue.pending == 0)
    checks["auroc"].update(pending_before_compute=pending, waits=waits, slow=bool(delay))

    counts = (20, 7)  # uneven: torchmetrics cannot sync these, the oracle is the documented order
    delay = SLOW_S if rank == 1 else 0.0
    offloaded = offload_to_cpu(SlowSequenceMax(delay), max_pending=2, worker=WORKER)
    expected, by_rank = _ordered("sequence_max", counts, per_update=3)
    for batch in by_rank[rank]:
        offloaded.update(batch)
    queue = _queue_of(offloaded)
    pending, waits = queue.pending, queue.waits
    checks["sequence_max"] = _record([offloaded.compute()], [expected], settled=queue.pending == 0)
    checks["sequence_max"].update(pending_before_compute=pending, waits=waits, slow=bool(delay))
    return checks


class AUROCModel(pl.LightningModule):
    """Updates a ``BinaryAUROC`` in ``training_step`` and logs the Metric object, once per epoch."""

    def __init__(self, offload: bool) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(1, 1)
        auroc = BinaryAUROC(thresholds=None)
        self.auroc = offload_to_cpu(auroc, worker=WORKER) if offload else auroc

    def training_step(self, batch, batch_idx):
        x, target = batch
        scores = torch.sigmoid(self.layer(x)).squeeze(1)
        self.auroc.update(scores, target)
        self.log("auroc", self.auroc, on_step=False, on_epoch=True)
        loss = torch.nn.functional.binary_cross_entropy(scores, target.float())
        self.log("loss", loss, on_step=False, on_epoch=True, sync_dist=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)


def _fit(offload: bool, rank: int, out_dir: Path):
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(10 + rank)
    size = 3 + rank  # batch sizes differ across ranks, the number of steps does not (DDP syncs the gradients)
    x = torch.rand(3 * size, 1, generator=generator)
    target = ((x[:, 0] + torch.rand(3 * size, generator=generator)) > 1).long()  # x predicts it, not perfectly
    data = DataLoader(TensorDataset(x, target), batch_size=size)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        max_epochs=2,
        logger=False,
        default_root_dir=out_dir,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        use_distributed_sampler=False,
    )
    model = AUROCModel(offload)
    trainer.fit(model, data)
    return model, dict(trainer.callback_metrics)


def _lightning(rank, out_dir):
    """Scenario 6: a 2-process Lightning fit on gloo, the offloaded Metric logged as the plain one."""
    plain_model, plain = _fit(False, rank, out_dir)
    model, offloaded = _fit(True, rank, out_dir)
    keys = sorted(plain)
    check = _record(
        [offloaded[k] for k in keys if k in offloaded],
        [plain[k] for k in keys],
        same_keys=sorted(offloaded) == keys and "auroc" in keys,
        offloaded=_is_offloaded(model.auroc) and not _is_offloaded(plain_model.auroc),
        same_state=same_bytes(_states(model.auroc), _states(plain_model.auroc)),  # reset by Lightning at epoch end
    )
    check["values"] = {k: v.item() for k, v in offloaded.items()}
    return {"fit": check}


def main(out_dir: Path) -> None:
    # the group Lightning's DDP strategy finds in place (it starts none then); a hang in a collective fails fast
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    checks = {
        "compute": _compute_equals_plain(rank),
        "uneven": _uneven(rank, world),
        "sync_on_step": _sync_on_step(rank),
        "collection": _collection_and_wrappers(rank),
        "many_queued": _many_queued(rank),
        "lightning": _lightning(rank, out_dir),
    }
    finish_rank(out_dir, rank, world, {"checks": checks})


if __name__ == "__main__":
    main(Path(sys.argv[1]))
