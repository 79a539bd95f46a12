"""Run by tests/test_configured.py as 2 processes on gloo: each rank writes what its configured Metrics gave.

Each check compares a Metric given to ``store_states_on_cpu`` with the same Metric unconfigured: synced by
torchmetrics on the same 2 processes where it can sync, else in one process fed every rank's elements in the order
documented for ``_sync_dist`` (element by element, in rank order).

Usage: RANK=r WORLD_SIZE=2 MASTER_ADDR=... MASTER_PORT=... python tests/_states_ddp_worker.py OUT_DIR
"""

import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from _metrics import (
    ELEMENT_METRICS,
    EQUAL_COUNT_METRICS,
    SENTENCES,
    WRAPPERS,
    as_bytes,
    matrices,
    rouge,
    run_wrapper,
    same_bytes,
    sequences,
)
from _support import finish_rank
from torchmetrics import CatMetric

from lightning_store import store_states_on_cpu
from lightning_store.metrics._gather import _DTYPES, _gather_elements


def _record(got, expected, **extra):
    def plain(value):
        if isinstance(value, torch.Tensor):
            return {"dtype": str(value.dtype), "shape": list(value.shape), "bytes": as_bytes(value).tolist()}
        return [plain(v) for v in value]

    ok = same_bytes(got, expected) and all(extra.values())
    return {"ok": ok, "got": plain(got), "expected": plain(expected), **extra}


def _interleave(by_rank):
    """The order of ``_sync_dist``: the first element of every rank in rank order, then the second..."""
    longest = max(map(len, by_rank))
    return [elements[i] for i in range(longest) for elements in by_rank if i < len(elements)]


def _synced_raw(metric, attr):
    """The state ``attr`` as the sync leaves it: a list, or a tensor."""
    with metric.sync_context():
        state = getattr(metric, attr)
        return list(state) if isinstance(state, list) else state


def _outcome(fn, *args):
    """What ``fn(*args)`` returns, or its error as ``"TypeName: message"``."""
    try:
        return fn(*args)
    except Exception as err:
        return f"{type(err).__name__}: {err}"


def _elements(name, rank, count):
    _, make_data = EQUAL_COUNT_METRICS[name]
    return make_data(1000 * (rank + 1), count)


def main(out_dir: Path) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    checks = {}

    # the gather itself: shapes, dtypes, 0-d and empty elements, a rank with none, tiny chunks
    mixed = [
        [torch.arange(6.0).reshape(2, 3), torch.tensor(7, dtype=torch.int16), torch.zeros(0, 4), torch.ones(2) > 0],
        [torch.arange(5, dtype=torch.float64)],
    ]
    for name, by_rank in (
        ("elements_mixed", mixed),
        ("elements_empty_rank", [mixed[0], []]),
        ("elements_none_anywhere", [[], []]),
        ("elements_complex_bfloat16", [[torch.ones(2, dtype=torch.complex64)], [torch.ones(3, dtype=torch.bfloat16)]]),
        (
            "elements_every_dtype",
            [[torch.arange(6).reshape(2, 3).to(d) for d in _DTYPES], [torch.ones(1).to(d) for d in _DTYPES]],
        ),
    ):
        gathered = _gather_elements(by_rank[rank], dist.group.WORLD, chunk_bytes=16)
        checks[name] = _record(
            gathered, by_rank, local_kept=all(g is e for g, e in zip(gathered[rank], by_rank[rank], strict=True))
        )

    # list states kept one element per item: the same elements in the same order as torchmetrics, equal counts
    for name, (make, _) in EQUAL_COUNT_METRICS.items():
        for chunk_bytes in (16, 2**26):
            configured = store_states_on_cpu(make(), chunk_bytes=chunk_bytes)
            plain = make()
            for metric in (configured, plain):
                metric.update(_elements(name, rank, 3))
            attr = next(iter(plain._defaults))
            checks[f"{name}_state_{chunk_bytes}"] = _record(_synced_raw(configured, attr), _synced_raw(plain, attr))
            checks[f"{name}_{chunk_bytes}"] = _record([configured.compute()], [plain.compute()])

    # different numbers of elements (none on a rank too), where torchmetrics cannot sync: the documented order
    for counts in ((3, 1), (0, 2)):
        for name, (make, _) in ELEMENT_METRICS.items():
            configured = store_states_on_cpu(make(), chunk_bytes=64)
            if counts[rank]:
                configured.update(_elements(name, rank, counts[rank]))
            single = make(sync_on_compute=False)  # one process: no collective to run
            ordered = _interleave([_elements(name, r, counts[r]) for r in range(world)])
            reduction = next(iter(single._reductions.values()))  # the user's reduction gets the ordered elements
            single.update(reduction(ordered) if reduction is not None else ordered)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # compute before update, on the rank with none
                got = configured.compute()
            checks[f"{name}_uneven_{counts[0]}_{counts[1]}"] = _record([got], [single.compute()])

    # ROUGE keeps one element per sentence: torchmetrics' own Metric, synced by torchmetrics
    configured, plain = store_states_on_cpu(rouge()), rouge()
    for metric in (configured, plain):
        for pred, target in SENTENCES[2 * rank : 2 * rank + 2]:
            metric.update(pred, target)
    got, expected = configured.compute(), plain.compute()
    checks["rouge"] = _record([got[k] for k in sorted(expected)], [expected[k] for k in sorted(expected)])

    # every wrapper torchmetrics ships, and a collection of Metrics and wrappers: their inner Metrics configured
    batches = [(100 * rank + i, 4 + rank + i) for i in range(4)]
    for name, (make, _) in WRAPPERS.items():
        configured = store_states_on_cpu(make(), chunk_bytes=32)
        got, expected = _outcome(run_wrapper, name, configured, batches), _outcome(run_wrapper, name, make(), batches)
        if isinstance(expected, str):  # torchmetrics fails (`Running` of list states on torchmetrics 1.0): the same
            checks[f"wrapper_{name}"] = {"ok": got == expected, "got": str(got), "expected": expected}
        else:
            checks[f"wrapper_{name}"] = _record(got, expected)

    # a list reduced by `dim_zero_cat` and empty on every process comes out as torchmetrics leaves it
    configured, plain = store_states_on_cpu(CatMetric()), CatMetric()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got, expected = _synced_raw(configured, "value"), _synced_raw(plain, "value")
    checks["cat_empty_everywhere"] = _record(got, expected, same_type=type(got) is type(expected))

    # dtype conversions reach the list states, which stay on the CPU
    configured, plain = store_states_on_cpu(CatMetric()), CatMetric()
    for metric in (configured, plain):
        metric.update(sequences(rank, 1)[0])
        metric.to(torch.float64)
    got = configured.compute()
    checks["dtype_float64"] = _record([got], [plain.compute()], on_cpu=all(t.is_cpu for t in configured.value))

    configured = store_states_on_cpu(ELEMENT_METRICS["matrices"][0]())
    plain = ELEMENT_METRICS["matrices"][0]()
    for metric in (configured, plain):
        metric.update(matrices(rank, 2))
        metric.to(dtype=torch.float16)
    checks["dtype_float16_elements"] = _record(_synced_raw(configured, "matrices"), _synced_raw(plain, "matrices"))

    finish_rank(out_dir, rank, dist.get_world_size(), {"checks": checks})


if __name__ == "__main__":
    main(Path(sys.argv[1]))
