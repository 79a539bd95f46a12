import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from _support import HANG_S
from torchmetrics.classification import BinaryAUROC

import lightning_store
from lightning_store._selfcheck import (
    _checks,
    _cli,
    _cuda,
    _env,
    _fits,
    _in_place,
    _metric,
    _offload,
    _offload_pays,
    _render,
    _timing,
    _values,
)
from lightning_store._selfcheck._core import Check, Context, Outcome, Skip, run_check

ROOT = Path(__file__).parent.parent
CHECK_IDS = [
    "values",
    "cpu_storage",
    "no_sync",
    "nccl_sync_dist",
    "step_time",
    "metric_states",
    "metric_nccl_sync",
    "in_place",
    "offload",
    "offload_pays",
]
IN_PLACE_NEEDS = "the copies to the CPU run on a side stream on CUDA only"
OFFLOAD_NEEDS = "the inputs' copies to the CPU without a host sync are CUDA's"
NO_CUDA = "needs CUDA, and no CUDA device was found: "
cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="asserts what a machine without CUDA gives")


@pytest.fixture(scope="module")
def cli_run(tmp_path_factory):
    """``python -m lightning_store --json -`` run for real, in an empty directory, with its own empty TMPDIR."""
    cwd, tmp = tmp_path_factory.mktemp("cwd"), tmp_path_factory.mktemp("tmp")
    env = {
        **os.environ,
        "TMPDIR": str(tmp),
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    process = subprocess.run(
        [sys.executable, "-m", "lightning_store", "--json", "-"],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=HANG_S,  # a bound against a hang, not a speed test
    )
    return process, cwd, tmp


def _fake_checks(*checks):
    return [Check(id_, title, run) for id_, title, run in checks]


def _raise(_context):
    raise RuntimeError("boom in the check")


def _skip(_context):
    raise Skip("not here")


def test_the_cli_writes_the_documented_json_and_nothing_else_to_stdout(cli_run):
    process, _, _ = cli_run
    document = json.loads(process.stdout)  # the whole of stdout is one JSON document
    assert process.returncode == document["exit_code"] == 0, process.stderr[-3000:]
    assert list(document) == [
        "schema",
        "exit_code",
        "accelerator",
        "seconds",
        "wall_seconds",
        "environment",
        "summary",
        "checks",
    ]
    assert document["schema"] == 1
    assert document["accelerator"] == ("cuda" if torch.cuda.is_available() else "cpu")
    # the wall time counts the imports too; neither is a speed test: the bound only catches a hang
    assert isinstance(document["seconds"], float) and 0 < document["seconds"] < document["wall_seconds"] < HANG_S
    env = document["environment"]
    assert list(env) == [
        "python",
        "platform",
        "torch",
        "accelerators",
        "pytorch-lightning",
        "lightning",
        "torchmetrics",
        "lightning-store",
        "PL_* variables",
        "CUDA_VISIBLE_DEVICES",
        "torch CPU threads",
        "fits run on",
    ]
    assert env["torch"].startswith(torch.__version__) and env["lightning-store"].startswith(lightning_store.__version__)
    assert [check["id"] for check in document["checks"]] == CHECK_IDS
    for check in document["checks"]:
        assert list(check) == ["id", "title", "status", "detail", "seconds", "data"]
        assert check["status"] in {"PASS", "FAIL", "SKIP", "INFO"}
        assert isinstance(check["detail"], str) and check["detail"]
        assert isinstance(check["seconds"], float) and isinstance(check["data"], dict)
    statuses = [check["status"] for check in document["checks"]]
    assert document["summary"] == {status: statuses.count(status) for status in ("PASS", "FAIL", "SKIP", "INFO")}


@cpu_only
def test_on_a_machine_without_cuda_the_cpu_checks_pass_and_the_cuda_checks_skip_with_their_reason(cli_run):
    process, _, _ = cli_run
    checks = {check["id"]: check for check in json.loads(process.stdout)["checks"]}
    assert checks["values"]["status"] == "PASS" and "bit for bit" in checks["values"]["detail"]
    assert checks["values"]["data"]["compared"] > 100 and checks["values"]["data"]["different"] == []
    storage = checks["cpu_storage"]
    assert storage["status"] == "PASS" and storage["data"]["accelerator_bytes"] == 0
    assert {row["device"] for row in storage["data"]["storage_report"]} == {"cpu"}
    assert {row["store_on_cpu"] for row in storage["data"]["storage_report"]} == {True}
    assert checks["no_sync"]["status"] == "SKIP"
    assert checks["no_sync"]["detail"] == NO_CUDA + "host syncs are counted with torch.cuda.set_sync_debug_mode"
    assert checks["nccl_sync_dist"]["status"] == "SKIP"
    assert checks["nccl_sync_dist"]["detail"] == NO_CUDA + "NCCL runs on CUDA devices only"
    timing = checks["step_time"]
    assert timing["status"] == "INFO" and timing["data"]["ratio"] > 0
    assert len(timing["data"]["stored_step_s"]) == len(timing["data"]["plain_step_s"]) == _timing.ROUNDS
    assert checks["metric_states"]["status"] == "PASS", checks["metric_states"]["detail"]
    assert checks["metric_states"]["data"]["accelerator_bytes"] == 0
    assert checks["metric_states"]["data"]["state_tensors"] > 0
    assert checks["metric_nccl_sync"]["detail"] == NO_CUDA + "NCCL runs on CUDA devices only"
    assert (checks["in_place"]["status"], checks["in_place"]["detail"]) == ("SKIP", NO_CUDA + IN_PLACE_NEEDS)
    offload = checks["offload"]  # its CPU part passes, its CUDA part is skipped with the reason
    assert offload["status"] == "PASS", offload["detail"]
    assert offload["detail"].endswith(f"; its CUDA part skipped ({NO_CUDA}{OFFLOAD_NEEDS})")
    assert offload["data"]["cuda"] is None and offload["data"]["cuda_skipped"] == NO_CUDA + OFFLOAD_NEEDS
    assert offload["data"]["cpu"]["same"] == {"BinaryAUROC": True, "MulticlassConfusionMatrix": True}
    pays = checks["offload_pays"]  # a measurement, on the CPU too: which worker, if any, pays beside such a step
    assert pays["status"] == "INFO" and set(pays["data"]["ratios"]) == {"inline", "thread", "process"}
    assert all(ratio > 0 for ratio in pays["data"]["ratios"].values())
    best = pays["data"]["best"]
    assert pays["detail"].endswith(f"(medians of {_offload_pays.ROUNDS} rounds of {_offload_pays.STEPS} steps)")
    assert ("does not pay" in pays["detail"]) == (best == "inline") and best in pays["data"]["ratios"]
    assert f" with {pays['data']['torch_threads']} torch thread(s), over the step without (" in pays["detail"]
    per_update = pays["data"]["per_update_s"]  # as each offloaded Metric measures it to warn that it does not pay
    assert set(per_update) == {"thread", "process"}
    for worker, (handoff, saved, held) in per_update.items():
        assert handoff > 0 and saved > 0 and held >= 0 and (worker == "thread" or held == 0)
        assert f"worker {worker}: a hand-off of {handoff * 1e3:.3f} ms" in pays["detail"]
        said = "no warning" if handoff + held < saved else "it warns: costs more than it saves"
        assert f"against {saved * 1e3:.3f} ms of work moved ({said})" in pays["detail"]
    start_s, resident = pays["data"]["worker_start_s"], pays["data"]["worker_resident_bytes"]
    assert start_s > 0 and f"a worker process started in {start_s:.1f} s and held" in pays["detail"]
    if sys.platform == "linux":  # read from /proc: a Python process with torch imported holds tens of MiB at least
        assert resident > 50 * 2**20 and f" {resident / 2**20:.0f} MiB then" in pays["detail"]


@cpu_only
def test_the_text_report_fits_the_terminals_width(tmp_path):
    """The real report, every check run: the environment, each check's detail and the storage table wrap or drop
    columns to fit ``COLUMNS``."""
    env = {
        **os.environ,
        "COLUMNS": "80",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    process = subprocess.run(
        [sys.executable, "-m", "lightning_store"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=HANG_S
    )
    assert process.returncode == 0, process.stdout + process.stderr
    lines = process.stdout.splitlines()
    assert max(len(line) for line in lines) <= 80, max(lines, key=len)
    after = lines[lines.index("PASS  state on the CPU during the fit") :]
    table = after[next(i for i, line in enumerate(after) if line.split()[:1] == ["loop"]) :]
    assert table[0].split() == ["loop", "name", "kind", "set_by", "device", "bytes"]
    assert table[1].split() == ["train", "loss", "tensor", "store_on_cpu", "cpu", "16"]
    assert len(lines) < 80  # every check of a CPU machine on one screen or so


def test_the_cli_leaves_no_file_behind(cli_run):
    _, cwd, tmp = cli_run
    assert list(cwd.iterdir()) == []  # no lightning_logs/, no checkpoints
    assert list(tmp.iterdir()) == []  # the fits' temporary directory is gone


def test_the_text_report_has_an_environment_block_a_line_per_check_and_a_summary(monkeypatch, capsys):
    monkeypatch.setattr(
        _checks,
        "CHECKS",
        _fake_checks(
            ("one", "first check", lambda _: Outcome("PASS", "fine", table="a  b\n1  2")),
            ("two", "second check", _skip),
            ("three", "a measurement", lambda _: Outcome("INFO", "ratio 1.00")),
        ),
    )
    monkeypatch.setenv("COLUMNS", "80")
    assert _cli.main(["--device", "cpu"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "lightning-store self-check"
    fits_run_on = "fits run on".ljust(len("CUDA_VISIBLE_DEVICES") + 2) + "cpu"  # labels aligned to the longest
    assert lines[2].startswith("python ") and fits_run_on in lines
    checks = lines[lines.index(fits_run_on) + 2 :]
    assert checks[:-3] == [
        "PASS  first check",
        "      fine",
        "      a  b",
        "      1  2",
        "SKIP  second check",
        "      (not here)",
        "INFO  a measurement",
        "      ratio 1.00",
    ]
    summary = " ".join(checks[-2:])  # wrapped to 80 characters
    assert summary.startswith("ok: 3 checks: 1 passed, 0 failed, 1 skipped, 1 measurement; ")
    assert re.fullmatch(r".*; \d+\.\d s since the process started, imports included \(0\.\d s in the checks\)", summary)


def test_an_exception_inside_a_check_is_a_fail_with_its_message_the_others_still_run_and_the_exit_code_is_1(
    monkeypatch, tmp_path, capsys
):
    ran = []
    monkeypatch.setattr(
        _checks,
        "CHECKS",
        _fake_checks(
            ("before", "before", lambda _: ran.append("before") or Outcome("PASS", "fine")),
            ("boom", "raises", _raise),
            ("after", "after", lambda _: ran.append("after") or Outcome("PASS", "fine")),
        ),
    )
    out = tmp_path / "selfcheck.json"
    assert _cli.main(["--json", str(out), "--device", "cpu"]) == 1
    assert ran == ["before", "after"]
    document = json.loads(out.read_text())
    assert document["exit_code"] == 1 and document["summary"] == {"PASS": 2, "FAIL": 1, "SKIP": 0, "INFO": 0}
    failed = document["checks"][1]
    assert failed["status"] == "FAIL" and failed["detail"] == "RuntimeError: boom in the check"
    assert "raise RuntimeError" in failed["data"]["traceback"]
    text = capsys.readouterr().out
    assert "FAIL  raises\n      RuntimeError: boom in the check\n" in text
    assert "FAILED: 3 checks: 2 passed, 1 failed, 0 skipped, 0 measurements; " in text


def test_a_real_check_that_finds_a_difference_fails_and_the_exit_code_is_1(monkeypatch, capsys):
    """The values check, on real fits, with a model whose CPU-stored run logs one value off by one."""

    class SkewedModel(_values.ValuesModel):
        def _log(self, name, value, **kwargs):
            super()._log(name, value + 1 if self.store and name == "x_max" else value, **kwargs)

    monkeypatch.setattr(_values, "ValuesModel", SkewedModel)
    monkeypatch.setattr(_checks, "CHECKS", [check for check in _checks.CHECKS if check.id == "values"])
    assert _cli.main(["--json", "-", "--device", "cpu"]) == 1
    (check,) = json.loads(capsys.readouterr().out)["checks"]
    assert check["status"] == "FAIL" and "values differ" in check["detail"] and "x_max" in check["detail"]
    assert all("x_max" in different for different in check["data"]["different"])


def test_the_cuda_checks_skip_with_their_reason_when_the_fits_run_on_the_cpu(tmp_path):
    context = Context("cpu", tmp_path)
    why_not = "no CUDA device was found" if not torch.cuda.is_available() else "--device cpu"
    for check_id, what in [
        ("no_sync", "host syncs are counted with torch.cuda.set_sync_debug_mode"),
        ("nccl_sync_dist", "NCCL runs on CUDA devices only"),
        ("metric_nccl_sync", "NCCL runs on CUDA devices only"),
        ("in_place", IN_PLACE_NEEDS),
    ]:
        (check,) = [check for check in _checks.CHECKS if check.id == check_id]
        result = run_check(check, context)
        assert (result.status, result.detail) == ("SKIP", f"needs CUDA, and {why_not}: {what}"), check_id
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("stored_syncs", "status"), [(lambda step: 0, "PASS"), (lambda step: 1 if step == 5 else 0, "FAIL")]
)
def test_the_sync_check_counts_per_call_and_fails_on_a_sync_after_the_first_step(
    monkeypatch, tmp_path, stored_syncs, status
):
    """Check 3 on the CPU, its sync counter replaced (torch counts syncs on CUDA only): the fit and the verdict."""
    steps = []

    def fake_host_syncs(call, blocked):
        call()
        if call.args == ("cpu_0",):
            steps.append(len(steps))
        return stored_syncs(steps[-1]) if call.keywords.get("store_on_cpu") else 0

    monkeypatch.setattr(_cuda, "host_syncs", fake_host_syncs)
    monkeypatch.setattr(_cuda, "require_cuda", lambda *args: None)
    outcome = _cuda.check_no_sync(Context("cpu", tmp_path))
    assert outcome.status == status, outcome.detail
    assert outcome.data["plain_syncs_per_step"] == [0] * _cuda.STEPS
    assert outcome.data["stored_syncs_per_step"] == [10 * stored_syncs(step) for step in range(_cuda.STEPS)]
    found = 10 if status == "FAIL" else 0
    assert outcome.detail.startswith(f"{found} host syncs in self.log(..., store_on_cpu=True) after the first step")
    assert "(29 steps x 10 keys); first step, where Lightning registers the keys: 0 and 0" in outcome.detail
    assert ("more than plain self.log at steps [5]" in outcome.detail) == (status == "FAIL")


def test_the_sync_dist_check_runs_one_process_ddp_fits_and_leaves_no_process_group_behind(tmp_path):
    """The body of the NCCL check, on gloo: what a GPU machine runs, but for the backend."""
    environ, threads = dict(os.environ), torch.get_num_threads()
    outcome = _cuda.sync_dist_outcome(Context("cpu", tmp_path), expected_backend="gloo")
    assert outcome.status == "PASS", outcome.detail
    assert outcome.data["backend"] == "gloo" and outcome.data["values"]["different"] == []
    assert outcome.data["from_cpu"]["compared"] > 10  # the value logged from the CPU, every step and the epoch
    assert not torch.distributed.is_initialized()
    assert dict(os.environ) == environ and torch.get_num_threads() == threads
    # the same fits, expecting NCCL: the check tells a run on another backend
    failed = _cuda.sync_dist_outcome(Context("cpu", tmp_path), expected_backend="nccl")
    assert failed.status == "FAIL" and "process-group backends 'gloo' and 'gloo', not 'nccl'" in failed.detail


def test_the_metric_sync_check_runs_one_process_ddp_fits_on_gloo(tmp_path):
    outcome = _metric.metric_sync_outcome(Context("cpu", tmp_path), lightning_store.store_states_on_cpu, "gloo")
    assert outcome.status == "PASS", outcome.detail
    assert outcome.data["backend"] == "gloo" and outcome.data["accelerator_bytes"] == 0
    assert not torch.distributed.is_initialized()


def test_the_in_place_check_runs_its_fits_and_its_metric_on_the_cpu_and_fails_where_a_change_reaches_a_value(
    monkeypatch, tmp_path, fake_device
):
    """Check 7's body on the CPU: its fits, its Metric and its verdicts.

    On the CPU a configured Metric keeps a CPU input itself, as a plain one does: ``fake_device`` has it copy the
    input through the buffer, as on CUDA.
    """
    context = Context("cpu", tmp_path)
    configure = getattr(lightning_store, "store_states_on_cpu", None)
    outcome = _in_place.in_place_outcome(context, configure)
    assert outcome.status == "PASS", outcome.detail
    assert outcome.data["logged"]["compared"] > 50 and outcome.data["logged"]["different"] == []
    assert "each logged right before a change in place, as plain self.log logs them" in outcome.detail
    if configure is not None:
        assert outcome.data["metric_updates"] == _in_place.UPDATES
        assert outcome.data["metric_elements_different"] == 0 and outcome.data["metric_states_on_cpu"]
    # a Metric left as it is keeps the inputs themselves: the change reaches them
    unconfigured = _in_place.in_place_outcome(context, lambda metric: metric)
    assert unconfigured.status == "FAIL" and "elements saw the change" in unconfigured.detail

    class SkewedModel(_in_place.InPlaceModel):
        def _log(self, name, value, **kwargs):
            super()._log(name, value * 2 if self.store and name == "running" else value, **kwargs)

    monkeypatch.setattr(_in_place, "InPlaceModel", SkewedModel)
    skewed = _in_place.in_place_outcome(context, None)
    assert skewed.status == "FAIL" and skewed.detail.startswith("logged values: ") and "running" in skewed.detail
    assert skewed.data["metric_updates"] == 0


def test_the_offload_check_passes_on_the_cpu_and_skips_its_cuda_part_with_the_reason(tmp_path):
    (check,) = [check for check in _checks.CHECKS if check.id == "offload"]
    assert check.title == "Metric offloaded to the CPU"
    result = run_check(check, Context("cpu", tmp_path))
    why_not = "no CUDA device was found" if not torch.cuda.is_available() else "--device cpu"
    assert result.status == "PASS", result.detail
    assert result.detail == (
        f"BinaryAUROC(thresholds=200) and MulticlassConfusionMatrix(num_classes=5), {_offload.BATCHES} updates each on"
        " the CPU, in a worker process and in a worker thread, every one queued: values bit for bit those of the"
        " plain Metrics, every state on the CPU;"
        f" its CUDA part skipped (needs CUDA, and {why_not}: {OFFLOAD_NEEDS})"
    )
    cpu = result.data["cpu"]
    assert cpu["updates"] == _offload.BATCHES and cpu["syncs"] is None
    assert cpu["queued"] == {"BinaryAUROC": _offload.BATCHES, "MulticlassConfusionMatrix": _offload.BATCHES}
    assert cpu["state_devices"] == cpu["metric_devices"] == {"cpu"} and cpu["device_bytes"] == 0
    assert cpu["same"] == result.data["cpu_thread"]["same"] == {"BinaryAUROC": True, "MulticlassConfusionMatrix": True}
    assert result.data["cpu_thread"]["queued"] == cpu["queued"]
    assert list(tmp_path.iterdir()) == []


def test_the_offload_checks_cuda_part_runs_on_the_cpu_counting_every_update_after_the_first(monkeypatch):
    """Its CUDA part on the CPU, its sync counter replaced (torch counts syncs on CUDA only): the run, the figures."""
    counted = []

    def fake_host_syncs(call, blocked):
        counted.append(call.func.__qualname__)  # the Metric's own `update`, wrapped
        call()
        return 0

    monkeypatch.setattr(_offload, "host_syncs", fake_host_syncs)
    outcome = _offload.offload_outcome(torch.device("cpu"))
    assert outcome.status == "PASS", outcome.detail
    assert len(counted) == 2 * _offload.UPDATES  # the first update of each Metric is not counted
    assert set(counted) == {"BinaryPrecisionRecallCurve.update", "MulticlassConfusionMatrix.update"}
    run = outcome.data["cuda"]
    assert run["updates"] == _offload.UPDATES + 1 and run["syncs"] == 0 and run["device_bytes"] == 0
    assert run["same"] == {"BinaryAUROC": True, "MulticlassConfusionMatrix": True}
    assert run["device_diff"] == {"BinaryAUROC": 0.0, "MulticlassConfusionMatrix": 0.0}
    assert (
        f"; on cpu, in a module moved with .cuda(): 0 host syncs in {_offload.UPDATES} updates each after the first"
        in outcome.detail
    )
    assert (
        "the plain Metrics run on cpu differ from them by at most 0 (BinaryAUROC), 0 (MulticlassConfusionMatrix)"
        in (outcome.detail)
    )


def test_the_offload_check_fails_on_a_host_sync_in_an_update(monkeypatch):
    calls = []

    def fake_host_syncs(call, blocked):
        call()
        calls.append(call)
        return 1 if len(calls) == 7 else 0

    monkeypatch.setattr(_offload, "host_syncs", fake_host_syncs)
    outcome = _offload.offload_outcome(torch.device("cpu"))
    assert outcome.status == "FAIL" and outcome.data["cuda"]["syncs"] == 1
    assert outcome.detail == f"on cpu: 1 host syncs in the {_offload.UPDATES} updates per Metric after the first"


@pytest.mark.parametrize(
    ("configure", "problem"),
    [
        (lambda metric, worker: metric, "BinaryAUROC: 0 of its 12 updates went through its queue"),
        (
            lambda metric, worker: lightning_store.offload_to_cpu(
                BinaryAUROC(thresholds=100) if isinstance(metric, BinaryAUROC) else metric, worker=worker
            ),
            "BinaryAUROC's value differs from the plain Metric's",
        ),
    ],
    ids=["not offloaded", "another value"],
)
def test_the_offload_check_fails_where_a_metric_is_not_offloaded_or_its_value_differs(
    monkeypatch, tmp_path, configure, problem
):
    monkeypatch.setattr(_offload, "offload_to_cpu", configure)
    outcome = _offload.check_offload(Context("cpu", tmp_path))
    assert outcome.status == "FAIL"
    assert outcome.detail.startswith(f"on the CPU, worker='process': {problem}"), outcome.detail
    assert f"on the CPU, worker='thread': {problem}" in outcome.detail


def test_help_documents_json_and_the_exit_status(capsys):
    with pytest.raises(SystemExit) as exit_:
        _cli.main(["--help"])
    assert exit_.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "--json PATH" in text and "'-' writes them to stdout" in text
    assert "exit status: 0 every check that ran passed 1 a check failed 2 a usage error," in text
    assert "The fits ignore PL_TRAINER_* defaults (the report lists them)." in text
    assert "Metrics given to store_states_on_cpu and offload_to_cpu are checked against the plain ones" in text


EXIT_STATUS_TABLE = [
    "exit status:",
    "    0  every check that ran passed",
    "    1  a check failed",
    "    2  a usage error, or --json could not be written",
    "  130  interrupted (Ctrl-C)",
]


@pytest.mark.parametrize("columns", [80, 120])
def test_help_is_wrapped_to_the_terminal_width_never_inside_a_word_and_keeps_the_exit_status_table(
    monkeypatch, capsys, columns
):
    monkeypatch.setenv("COLUMNS", str(columns))  # what argparse reads the terminal's width from
    with pytest.raises(SystemExit):
        _cli.main(["--help"])
    text = capsys.readouterr().out
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= columns, max(lines, key=len)
    usage, description, options, epilog = text.split("\n\n")
    assert usage.startswith("usage: python -m lightning_store ")
    assert " ".join(description.split()) == " ".join(_cli._DESCRIPTION.split())  # no word split across lines
    # wrapped to the width: argparse's is the terminal's less 2, and a line breaks before a word of at most 18
    assert max(len(line) for line in description.splitlines()) > columns - 2 - 19
    assert options.startswith("options:") and "--json PATH" in options
    assert epilog.splitlines() == EXIT_STATUS_TABLE


@cpu_only
def test_asking_for_a_device_that_is_not_there_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_:
        _cli.main(["--device", "cuda"])
    assert exit_.value.code == 2
    assert "--device cuda: no such device is available here" in capsys.readouterr().err


def test_json_has_no_nan_and_no_sets():
    assert _render._jsonable({"a": float("nan"), "b": {2, 1}, "c": (1, float("inf"))}) == {
        "a": None,
        "b": [1, 2],
        "c": [1, None],
    }


def _must_not_run(_context):
    raise AssertionError("a check ran before the usage error")


@pytest.mark.parametrize(
    ("where", "problem"),
    [
        ("missing/x.json", "its directory {tmp}/missing does not exist; create it first"),
        (".", "is a directory; give a file name, such as {tmp}/selfcheck.json"),
        ("a_file/x.json", "{tmp}/a_file is not a directory"),
    ],
)
def test_a_json_path_that_cannot_be_written_is_a_usage_error_before_any_check_runs(
    monkeypatch, tmp_path, capsys, where, problem
):
    monkeypatch.setattr(_checks, "CHECKS", _fake_checks(("never", "never", _must_not_run)))
    (tmp_path / "a_file").touch()
    path = str(tmp_path / where) if where != "." else str(tmp_path)
    with pytest.raises(SystemExit) as exit_:
        _cli.main(["--json", path, "--device", "cpu"])
    assert exit_.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == ""  # nothing ran, nothing was printed
    expected = f"argument --json: cannot write the report to {path}: {problem.format(tmp=tmp_path)}"
    assert captured.err.splitlines()[-1] == f"python -m lightning_store: error: {expected}"


def test_a_json_path_in_a_missing_directory_ends_at_once_with_one_line_and_no_traceback(tmp_path):
    process = subprocess.run(
        [sys.executable, "-m", "lightning_store", "--json", "/nonexistent/dir/x.json"],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))},
        capture_output=True,
        text=True,
        timeout=HANG_S,
    )
    assert process.returncode == 2 and process.stdout == ""
    assert "Traceback" not in process.stderr
    assert process.stderr.splitlines()[-1] == (
        "python -m lightning_store: error: argument --json: cannot write the report to /nonexistent/dir/x.json:"
        " its directory /nonexistent/dir does not exist; create it first"
    )


def _in_group(group: int) -> list[int]:
    """The processes of process group ``group`` still there (zombies aside), from ``/proc``."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            state, _, pgrp = (entry / "stat").read_text().rpartition(")")[2].split()[:3]
        except (OSError, ValueError):  # not a process, or one that just ended
            continue
        if int(pgrp) == group and state != "Z":
            found.append(int(entry.name))
    return found


@pytest.mark.faults  # processes' signals, which no Lightning release changes: not run again on each one
@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads the processes left from /proc")
def test_ctrl_c_ends_the_cli_with_one_line_and_130_and_leaves_no_process(tmp_path):
    process = subprocess.Popen(
        [sys.executable, "-m", "lightning_store"],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # a process group of its own, which Ctrl-C in a terminal signals as a whole
    )
    try:
        assert process.stdout is not None
        for line in process.stdout:  # the next check runs each way in a process of its own, and a worker process
            if line.startswith("PASS  Metric offloaded to the CPU"):
                break
        time.sleep(1.0)  # they import torch: seconds
        os.killpg(process.pid, signal.SIGINT)
        out, err = process.communicate(timeout=HANG_S)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    assert process.returncode == 130, err[-3000:]
    assert err.strip().splitlines() == ["python -m lightning_store: interrupted"], err[-3000:]
    assert "offload beside a Python step" not in out  # interrupted while it ran
    deadline = time.monotonic() + 30.0  # an offload worker process ends soon after its parent
    while _in_group(process.pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _in_group(process.pid) == []


def test_a_json_file_that_cannot_be_written_after_the_checks_is_exit_2_with_one_line(monkeypatch, tmp_path, capsys):
    target = tmp_path / "gone"
    target.mkdir()
    monkeypatch.setattr(_checks, "CHECKS", _fake_checks(("rm", "removes the directory", lambda _: _rmdir(target))))
    assert _cli.main(["--json", str(target / "x.json"), "--device", "cpu"]) == 2
    assert capsys.readouterr().err == (
        f"python -m lightning_store: error: --json {target / 'x.json'}: cannot write it: No such file or directory\n"
    )


def _rmdir(path):
    path.rmdir()
    return Outcome("PASS", "removed")


def test_the_fits_ignore_the_users_trainer_defaults_and_the_report_says_so(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("PL_TRAINER_LIMIT_VAL_BATCHES", "0")
    monkeypatch.setenv("PL_TRAINER_MAX_EPOCHS", "7")
    monkeypatch.setenv("PL_GLOBAL_SEED", "3")
    seen = {}

    def probe(context):
        trainer = _fits.make_trainer(context)
        seen.update(limit_val_batches=trainer.limit_val_batches, max_epochs=trainer.max_epochs)
        seen["env"] = sorted(name for name in os.environ if name.startswith("PL_"))
        return Outcome("PASS", "probed")

    monkeypatch.setattr(_checks, "CHECKS", _fake_checks(("probe", "probe", probe)))
    assert _cli.main(["--device", "cpu"]) == 0
    assert seen == {"limit_val_batches": 1.0, "max_epochs": 2, "env": ["PL_GLOBAL_SEED"]}
    assert os.environ["PL_TRAINER_LIMIT_VAL_BATCHES"] == "0" and os.environ["PL_TRAINER_MAX_EPOCHS"] == "7"
    out = capsys.readouterr().out
    block = out[out.index("PL_* variables") : out.index("CUDA_VISIBLE_DEVICES")]  # wrapped to the terminal's width
    assert " ".join(block.split()[2:]) == (
        "PL_GLOBAL_SEED=3, PL_TRAINER_LIMIT_VAL_BATCHES=0 (ignored by the fits),"
        " PL_TRAINER_MAX_EPOCHS=7 (ignored by the fits)"
    )


def test_the_environment_shows_pl_variables_cuda_visible_devices_and_torch_threads(monkeypatch):
    for name in [name for name in os.environ if name.startswith("PL_")] + ["OMP_NUM_THREADS", "MKL_NUM_THREADS"]:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    env = _env.environment()
    cpus = len(os.sched_getaffinity(0))
    assert env["PL_* variables"] == "none set" and env["CUDA_VISIBLE_DEVICES"] == "not set"
    assert env["torch CPU threads"] == f"{torch.get_num_threads()} (of {cpus} CPUs this process may use)"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,0")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        env = _env.environment()
    finally:
        torch.set_num_threads(threads)
    assert env["CUDA_VISIBLE_DEVICES"] == "1,0"
    assert env["torch CPU threads"] == f"1 (of {cpus} CPUs this process may use, OMP_NUM_THREADS=1)"


def test_the_wall_time_counts_from_the_start_of_the_process():
    first = _cli.seconds_since_start()
    time.sleep(0.3)
    second = _cli.seconds_since_start()
    assert first is not None and second is not None
    assert first > 0 and 0.2 < second - first < 5  # /proc counts in clock ticks (10 ms)
