from pathlib import Path

import pytest
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
