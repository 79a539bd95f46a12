from pathlib import Path

import pytest
from _metrics import ELEMENT_METRICS, WRAPPERS
from _support import REDUCTIONS, run_workers

WORKER = Path(__file__).with_name("_ddp_worker.py")
STEPS = 3


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory):
    """Both ranks' records of one 2-process DDP fit on gloo (Lightning starts the second rank)."""
    return run_workers(WORKER, tmp_path_factory.mktemp("ddp"), one_process_launches_all=True)


def _expected(reduce_fx: str, level: str) -> float:
    """What ``sync_dist=True`` gives: rank r logs ``10 * (r + 1) + i`` with batch size ``i + 1`` at step i."""
    steps = range(STEPS)
    values = [(10.0 * (rank + 1) + i, i + 1) for rank in (0, 1) for i in steps]
    if level == "step":  # the last step's value, reduced across the two ranks
        last = [10.0 * (rank + 1) + STEPS - 1 for rank in (0, 1)]
        return {"mean": sum(last) / 2, "sum": sum(last), "max": max(last), "min": min(last)}[reduce_fx]
    return {
        "mean": sum(v * n for v, n in values) / sum(n for _, n in values),
        "sum": sum(v for v, _ in values),
        "max": max(v for v, _ in values),
        "min": min(v for v, _ in values),
    }[reduce_fx]


@pytest.mark.distributed
@pytest.mark.parametrize("stage", ["train", "val"])
@pytest.mark.parametrize("reduce_fx", REDUCTIONS)
def test_sync_dist_reduces_cpu_stored_values_across_processes(ddp_run, stage, reduce_fx):
    for rank, seen in enumerate(ddp_run):
        metrics = {**seen["logged"], **seen["callback_metrics"]}
        checks = {
            f"{stage}_{reduce_fx}_10": _expected(reduce_fx, "step"),
            f"{stage}_{reduce_fx}_11_step": _expected(reduce_fx, "step"),
            f"{stage}_{reduce_fx}_01": _expected(reduce_fx, "epoch"),
            f"{stage}_{reduce_fx}_11_epoch": _expected(reduce_fx, "epoch"),
        }
        for name, expected in checks.items():
            assert metrics[f"cpu_{name}"] == pytest.approx(expected, rel=1e-6), (rank, name)
            assert metrics[f"cpu_{name}"] == metrics[f"dev_{name}"], (rank, name)  # the same as Lightning's own
            if f"cpu_{name}" in seen["devices"]:
                assert seen["devices"][f"cpu_{name}"] == "cpu"


@pytest.mark.distributed
def test_every_cpu_stored_key_kept_its_state_on_the_cpu_on_every_rank(ddp_run):
    for seen in ddp_run:
        cpu_keys = sorted(key for key in seen["storage"] if key.split(".")[1].startswith("cpu_"))
        assert len(cpu_keys) == len(REDUCTIONS) * 3
        assert seen["stored_keys"] == cpu_keys
        for key in cpu_keys:
            class_name, devices = seen["storage"][key]
            assert class_name.startswith("_StoredOnCPU") and devices and set(devices) == {"cpu"}, key


FLAG_WORKER = Path(__file__).with_name("_flag_ddp_worker.py")


@pytest.fixture(scope="module")
def flag_run(tmp_path_factory):
    """Both ranks' records of a module without the mixin fitted by a plain Trainer, then under the flag."""
    return run_workers(FLAG_WORKER, tmp_path_factory.mktemp("flag_ddp"))


@pytest.mark.distributed
def test_the_flag_reduces_every_key_as_plain_lightning_does_bit_for_bit(flag_run):
    for seen in flag_run:
        plain, flagged = seen["plain"], seen["flag"]
        assert plain["logged"] and plain["callback_metrics"]
        # floats through JSON keep every bit of a float64, so equality is bit for bit
        assert flagged["logged"] == plain["logged"]
        assert flagged["callback_metrics"] == plain["callback_metrics"]
        assert {"train_sum_01", "train_mean_11_epoch", "val_max_01", "train_number", "auroc"} <= set(
            plain["callback_metrics"]
        )
        assert flagged["class"] == plain["class"] == "PlainSyncModel"
    assert flag_run[0]["plain"]["callback_metrics"] == flag_run[1]["plain"]["callback_metrics"]  # reduced: the same


@pytest.mark.distributed
def test_the_flag_keeps_every_key_and_the_metrics_list_states_on_the_cpu_on_every_rank(flag_run):
    for seen in flag_run:
        plain, flagged = seen["plain"], seen["flag"]
        assert sorted(flagged["storage"]) == sorted(plain["storage"]) and len(plain["storage"]) == 4 * 3 + 2
        for key, (class_name, devices) in flagged["storage"].items():
            assert class_name.startswith("_StoredOnCPU") and devices == ["cpu"], key
        assert not any(name.startswith("_StoredOnCPU") for name, _ in plain["storage"].values())
        assert flagged["auroc_on_cpu"] is True and plain["auroc_on_cpu"] is False
        assert set(flagged["devices"].values()) == {"cpu"}


OFFLOAD_WORKER = Path(__file__).with_name("_offload_ddp_worker.py")


@pytest.fixture(scope="module", params=["thread", "process"])
def offload_run(tmp_path_factory, request):
    """Both ranks' checks of the scenarios in ``_offload_ddp_worker.py``, one process per rank (and a fit), with
    every Metric offloaded to a worker thread, then to a worker process."""
    out = tmp_path_factory.mktemp(f"offload_ddp_{request.param}")
    return run_workers(OFFLOAD_WORKER, out, OFFLOAD_WORKER=request.param)


def _offload_checks(offload_run, scenario, expected):
    """The checks of ``scenario`` on each rank, asserted to be there (the same on both) and to pass."""
    by_rank = [seen["checks"][scenario] for seen in offload_run]
    assert set(by_rank[0]) == set(by_rank[1]) and expected <= set(by_rank[0]), expected - set(by_rank[0])
    for rank, checks in enumerate(by_rank):
        failed = {name: check for name, check in checks.items() if not check["ok"]}
        assert not failed, (rank, failed)
    for name, check in by_rank[0].items():  # a synced value is the same on every rank
        if check["synced"]:
            assert by_rank[0][name]["got"] == by_rank[1][name]["got"], name
    return by_rank


@pytest.mark.distributed
def test_offloaded_metric_computes_on_both_ranks_as_the_plain_metric(offload_run):
    names = {"auroc", "confusion_matrix", "mean"}
    _offload_checks(offload_run, "compute", names | {f"{n}_local_state" for n in names} | {f"{n}_again" for n in names})


@pytest.mark.distributed
def test_offloaded_metric_syncs_uneven_update_counts_and_a_rank_without_update(offload_run):
    expected = {"auroc_3_1", "auroc_3_1_single", "auroc_0_2_single"}  # plain fails to sync a rank without update
    for counts in ("3_1", "0_2"):
        expected |= {f"{name}_{counts}" for name in ("confusion_matrix", "mean", *ELEMENT_METRICS)}
    _offload_checks(offload_run, "uneven", expected)


@pytest.mark.distributed
def test_offloaded_metric_forward_syncs_each_batch_as_the_plain_metric(offload_run):
    _offload_checks(offload_run, "sync_on_step", {"auroc", "mean", *ELEMENT_METRICS})


@pytest.mark.distributed
def test_offloaded_collection_and_wrappers_sync_as_the_plain_ones(offload_run):
    _offload_checks(
        offload_run,
        "collection",
        {"collection", "collection_forward"} | {f"wrapper_{n}" for n in WRAPPERS} - {"wrapper_BootStrapper"},
    )


@pytest.mark.distributed
def test_offloaded_metric_settles_a_full_queue_before_the_collective_on_every_rank(offload_run):
    by_rank = _offload_checks(offload_run, "many_queued", {"auroc", "sequence_max"})
    for name in by_rank[0]:
        slow = [checks[name] for checks in by_rank if checks[name]["slow"]]
        assert len(slow) == 1, name  # one rank reaches the collective last
        # its updates were still queued at `compute`, and `update` waited for room in the queue
        assert slow[0]["pending_before_compute"] >= 1 and slow[0]["waits"] >= 1, (name, slow[0])


@pytest.mark.distributed
def test_lightning_fit_logs_the_offloaded_metric_as_the_plain_one_on_both_ranks(offload_run):
    fits = [checks["fit"] for checks in _offload_checks(offload_run, "lightning", {"fit"})]
    assert set(fits[0]["values"]) == {"auroc", "loss"}
    assert 0 < fits[0]["values"]["auroc"] < 1  # not a degenerate value, which any order of the elements gives
