"""The runner of multi-process tests, ``_support.run_workers``, on tiny workers that need no torch."""

import json
import os
import re
import textwrap
from pathlib import Path

import _support
import pytest
from _support import run_workers

pytestmark = pytest.mark.no_lightning  # no Lightning here: not run again on each Lightning minor (.ci/run)

# Writes rank{RANK}.json with what it was given; tells the runner what to do through files beside it.
WORKER = """
import json, os, sys, time
from pathlib import Path

out = Path(sys.argv[1])
rank = os.environ.get("RANK", "launcher")
(out / f"pid-{rank}").write_text(str(os.getpid()))
print(f"rank {rank} on port {os.environ['MASTER_PORT']}")
taken = out / "port-taken-once"
if taken.exists() and rank in ("0", "launcher"):
    taken.unlink()
    sys.exit("RuntimeError: The server socket has failed to listen: EADDRINUSE (address already in use)")
if (out / "fail").exists() and rank == "1":
    sys.exit("rank 1 fails for a reason of its own")
if (out / "hang").exists():
    time.sleep(600)
names = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "EXTRA")
ranks = range(int(os.environ.get("RANKS_HERE", "1"))) if rank == "launcher" else [int(rank)]
for r in ranks:
    (out / f"rank{r}.json").write_text(json.dumps({name: os.environ.get(name) for name in names}))
"""


@pytest.fixture
def worker(tmp_path):
    path = tmp_path / "worker.py"
    path.write_text(textwrap.dedent(WORKER))
    out = tmp_path / "out"
    out.mkdir()
    return path, out


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_one_process_per_rank_each_with_its_rank_and_one_shared_port(worker):
    path, out = worker
    seen = run_workers(path, out, world_size=2, EXTRA="x")
    assert [s["RANK"] for s in seen] == ["0", "1"] and [s["LOCAL_RANK"] for s in seen] == ["0", "1"]
    assert {s["WORLD_SIZE"] for s in seen} == {"2"} and {s["EXTRA"] for s in seen} == {"x"}
    assert {s["MASTER_ADDR"] for s in seen} == {"127.0.0.1"} and len({s["MASTER_PORT"] for s in seen}) == 1
    assert _support.RUNS[-1].worker == "worker.py" and _support.RUNS[-1].attempts == 1
    assert sorted(p.name for p in out.glob("worker*.log")) == ["worker0.log", "worker1.log"]


def test_one_process_that_launches_all_gets_no_rank_variables(worker):
    path, out = worker
    seen = run_workers(path, out, world_size=2, one_process_launches_all=True, RANKS_HERE="2")
    assert [s["RANK"] for s in seen] == [None, None] and [s["WORLD_SIZE"] for s in seen] == [None, None]
    assert sorted(p.name for p in out.glob("worker*.log")) == ["worker0.log"]


def test_a_port_taken_before_the_bind_is_run_again_on_a_fresh_port(worker):
    path, out = worker
    (out / "port-taken-once").touch()
    seen = run_workers(path, out, world_size=2)
    assert [s["RANK"] for s in seen] == ["0", "1"]
    assert _support.RUNS[-1].attempts == 2


def test_a_failed_worker_fails_the_run_with_the_time_and_every_workers_output(worker):
    path, out = worker
    (out / "fail").touch()
    with pytest.raises(pytest.fail.Exception) as info:
        run_workers(path, out, world_size=2)
    message = str(info.value)
    assert message.startswith("the 2-process run of worker.py (attempt 1 of 3, port ")
    assert " failed after " in message and f"s (hang bound {_support.HANG_S:.0f} s)." in message
    assert "--- worker 0 (exit code 0)" in message and "--- worker 1 (exit code 1)" in message
    assert "rank 0 on port" in message and "rank 1 fails for a reason of its own" in message


def test_a_run_past_the_hang_bound_is_killed_and_failed_with_its_output(worker, monkeypatch):
    path, out = worker
    (out / "hang").touch()
    monkeypatch.setattr(_support, "HANG_S", 5.0)
    with pytest.raises(
        pytest.fail.Exception, match=r"did not end within the hang bound of 5 s after ([5-9]|1\d)\.\d s"
    ):
        run_workers(path, out, world_size=2)
    pids = [int((out / f"pid-{rank}").read_text()) for rank in (0, 1)]
    assert not any(_alive(pid) for pid in pids)  # the process groups were killed
    assert not list(out.glob("rank*.json"))


def test_stale_results_of_an_earlier_run_are_not_read(worker):
    path, out = worker
    (out / "rank1.json").write_text(json.dumps({"RANK": "stale"}))
    seen = run_workers(path, out, world_size=2)
    assert seen[1]["RANK"] == "1"


# Lightning, or lightning-store's parts for it, in a test module (its own text, matched by none of this pattern's)
USES_LIGHTNING = (
    r"\bpytorch_lightning\b|\b(?:import|from) lightning\b(?!_)|\bTrainer\b|quiet_trainer[_]kwargs|\bStoreOnCPUMixin\b"
    r'|\b_compat\b|\b_selfcheck\b|"lightning_store"\]'  # the last: `python -m lightning_store`, the self-check
)


def test_the_modules_marked_no_lightning_involve_no_lightning():
    """CI runs a module marked ``no_lightning`` in README's run and at the floors, not on each Lightning minor: one
    that used Lightning, in its imports or in the code it runs in other processes, would leave the minors untested."""
    marked = []
    for path in sorted(Path(__file__).parent.glob("test_*.py")):
        text = path.read_text()
        if "pytest.mark.no_lightning" not in text:
            continue
        marked.append(path.name)
        used = re.findall(USES_LIGHTNING, text)
        assert not used, f"{path.name} is marked no_lightning and uses Lightning: {used}"
    assert "test_worker.py" in marked and "test_offload.py" in marked
