"""Run by tests/test_metric_states.py as 2 processes on gloo: each rank writes what its Metrics computed.

Usage: RANK=r WORLD_SIZE=2 MASTER_ADDR=... MASTER_PORT=... python tests/_metric_ddp_worker.py OUT_DIR
"""

import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from _support import finish_rank
from torchmetrics import CatMetric, MetricCollection, SpearmanCorrCoef
from torchmetrics.classification import BinaryAUROC, BinaryAveragePrecision
from torchmetrics.retrieval import RetrievalMAP

from lightning_store import gather_on_device, store_states_on_cpu

SIZES = {0: (5, 3, 6), 1: (2, 7)}  # uneven: batch sizes and counts differ across ranks


def _data(rank, kind="binary"):
    generator = torch.Generator().manual_seed(100 + rank)
    batches = []
    for size in SIZES[rank]:
        preds = torch.rand(size, generator=generator)
        if kind == "regression":
            batches.append(((preds, preds * 2 + torch.rand(size, generator=generator)), {}))
        elif kind == "retrieval":
            target = torch.randint(0, 2, (size,), generator=generator)
            batches.append(((preds, target), {"indexes": torch.randint(0, 4, (size,), generator=generator)}))
        elif kind == "cat":
            batches.append(((preds,), {}))
        else:
            batches.append(((preds, torch.randint(0, 2, (size,), generator=generator)), {}))
    return batches


def _same(got, expected):
    if isinstance(got, torch.Tensor):
        return bool(got.dtype == expected.dtype and got.shape == expected.shape and torch.equal(got, expected))
    return len(got) == len(expected) and all(_same(g, e) for g, e in zip(got, expected, strict=True))


def _record(got, expected):
    def plain(value):
        return value.tolist() if isinstance(value, torch.Tensor) else [plain(v) for v in value]

    return {"ok": _same(got, expected), "got": plain(got), "expected": plain(expected)}


def _single_process(make, batches_by_rank):
    """The Metric kept on its device in one process, fed every rank's batches in rank order."""
    metric = make()
    for rank in sorted(batches_by_rank):
        for args, kwargs in batches_by_rank[rank]:
            metric.update(*args, **kwargs)
    metric.distributed_available_fn = lambda: False  # one process: no collective to run
    return metric.compute()


def _compare(make, kind, rank, with_plain=True, **on_cpu_kwargs):
    """(store_states_on_cpu, plain Metric on its device, single process) after the same updates.

    ``with_plain=False`` for a Metric whose list states have no reduction: torchmetrics gathers their elements one
    by one, so the plain Metric cannot sync when the processes made different numbers of updates (it would hang).
    """
    on_cpu, plain = store_states_on_cpu(make(), **on_cpu_kwargs), make()
    for args, kwargs in _data(rank, kind):
        on_cpu.update(*args, **kwargs)
        plain.update(*args, **kwargs)
    single = _single_process(make, {r: _data(r, kind) for r in SIZES})
    got = on_cpu.compute()
    assert all(t.is_cpu for attr in ("preds", "target", "value", "indexes") for t in getattr(on_cpu, attr, []))
    return got, plain.compute() if with_plain else single, single


def main(out_dir: Path) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    checks = {}

    local = torch.arange(rank * 10, rank * 10 + 3 + 4 * rank, dtype=torch.float32)
    expected = [torch.arange(0, 3, dtype=torch.float32), torch.arange(10, 17, dtype=torch.float32)]
    checks["gather_uneven_chunked"] = _record(gather_on_device(local, chunk_bytes=8), expected)

    local = torch.arange(10).reshape(5, 2) if rank == 0 else torch.empty(0)
    expected = [torch.arange(10).reshape(5, 2), torch.empty((0, 2), dtype=torch.int64)]
    checks["gather_empty_rank"] = _record(gather_on_device(local), expected)

    checks["gather_scalar"] = _record(
        gather_on_device(torch.tensor(rank + 1.0)), [torch.tensor(1.0), torch.tensor(2.0)]
    )

    rows = [torch.randn(3 + r, 4, generator=torch.Generator().manual_seed(r), dtype=torch.float64) for r in (0, 1)]
    checks["gather_2d_chunked"] = _record(gather_on_device(rows[rank], chunk_bytes=40), rows)

    got, plain, single = _compare(lambda: BinaryAUROC(thresholds=None), "binary", rank)
    checks["auroc_uneven"] = _record([got, got], [plain, single])

    metric = store_states_on_cpu(BinaryAUROC(thresholds=None), chunk_bytes=64)
    if rank == 0:
        for args, _ in _data(0):
            metric.update(*args)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # rank 1: compute before update
        got = metric.compute()
    single = _single_process(lambda: BinaryAUROC(thresholds=None), {0: _data(0)})
    checks["auroc_empty_rank_chunked"] = _record(got, single)

    def collection():
        return MetricCollection([BinaryAUROC(thresholds=None), BinaryAveragePrecision(thresholds=None)])

    on_cpu, plain = store_states_on_cpu(collection()), collection()
    for args, _ in _data(rank):
        on_cpu.update(*args)
        plain.update(*args)
    got, expected = on_cpu.compute(), plain.compute()
    checks["collection_compute_groups"] = _record(
        [got[k] for k in sorted(expected)], [expected[k] for k in sorted(expected)]
    )
    checks["collection_compute_groups"]["ok"] &= on_cpu.compute_groups == {0: ["BinaryAUROC", "BinaryAveragePrecision"]}

    group = dist.new_group([0, 1])
    got, plain, single = _compare(lambda: BinaryAUROC(thresholds=None, process_group=group), "binary", rank)
    checks["process_group"] = _record([got, got], [plain, single])

    on_cpu = store_states_on_cpu(BinaryAUROC(thresholds=None, dist_sync_on_step=True))
    plain = BinaryAUROC(thresholds=None, dist_sync_on_step=True)
    steps_got, steps_expected = [], []
    for args, _ in _data(rank)[:2]:  # both ranks have two batches at least: forward syncs at every step
        steps_got.append(on_cpu(*args))
        steps_expected.append(plain(*args))
    checks["dist_sync_on_step"] = _record([*steps_got, on_cpu.compute()], [*steps_expected, plain.compute()])

    got, plain, single = _compare(lambda: BinaryAUROC(thresholds=None, sync_on_compute=False), "binary", rank)
    local_only = _single_process(lambda: BinaryAUROC(thresholds=None), {rank: _data(rank)})
    checks["sync_on_compute_false"] = _record([got, got], [plain, local_only])

    for name, make, kind in (
        ("spearman", SpearmanCorrCoef, "regression"),
        ("retrieval_map", RetrievalMAP, "retrieval"),
        ("cat", CatMetric, "cat"),
    ):
        got, plain, single = _compare(make, kind, rank, with_plain=name != "retrieval_map", chunk_bytes=32)
        checks[name] = _record([got, got], [plain, single])

    finish_rank(out_dir, rank, dist.get_world_size(), {"checks": checks})


if __name__ == "__main__":
    main(Path(sys.argv[1]))
