"""Faults a long training job meets, with either worker: no hang, no crash, and errors that name the real cause."""

import ast
import contextlib
import errno
import os
import pickle
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch
from torch import Tensor
from torchmetrics import SumMetric

from lightning_store import offload_to_cpu
from lightning_store.metrics._offload.process.parent import _process_worker

pytestmark = pytest.mark.faults

HANG_BOUND_S = 120.0  # a run that hangs fails the test after this, rather than hanging the suite

PRELUDE = """
import contextlib, gc, os, pickle, signal, sys, threading, time
import torch
from torchmetrics import CatMetric, SumMetric
from lightning_store import offload_to_cpu
from lightning_store.metrics._offload.process import parent as _parent
from lightning_store.metrics._offload.process.parent import _process_worker
"""


FAULTY = """
import torch
from torchmetrics import SumMetric


class RaisesOnNegative(SumMetric):
    def __init__(self, exception="ValueError('negative')"):
        super().__init__()
        self.exception = exception

    def update(self, value):
        if value.sum() < 0:
            raise eval(self.exception)
        super().update(value)


class Slow(SumMetric):
    def update(self, value):
        import time

        time.sleep(10)  # longer than any wait of the test's: its worker process is killed in the first
        super().update(value)
"""


@pytest.fixture
def run(tmp_path):
    """Run a script by a Python of its own, beside a module ``faulty`` of Metrics a worker process can import."""
    (tmp_path / "faulty.py").write_text(FAULTY)

    def run(body: str, **env: str) -> subprocess.CompletedProcess:
        script = tmp_path / "script.py"
        script.write_text(PRELUDE + "\nif __name__ == '__main__':\n" + textwrap.indent(textwrap.dedent(body), "    "))
        path = os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])
        return _bounded([sys.executable, str(script)], env={**os.environ, "PYTHONPATH": path, **env}, cwd=tmp_path)

    return run


def _bounded(command: list[str], **kwargs) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(command, capture_output=True, text=True, timeout=HANG_BOUND_S, **kwargs)
    except subprocess.TimeoutExpired as expired:
        pytest.fail(f"hung: no end within {HANG_BOUND_S:.0f} s; its output: {expired.stdout!r} {expired.stderr!r}")


def _out(result: subprocess.CompletedProcess) -> list[str]:
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout.splitlines()


@pytest.mark.parametrize("exception", ["SystemExit(3)", "KeyboardInterrupt()", "GeneratorExit()"])
@pytest.mark.parametrize("worker", ["thread", "process"])
def test_a_base_exception_in_update_is_raised_at_the_next_call_and_the_worker_goes_on(run, worker, exception):
    out = _out(
        run(f"""
        from faulty import RaisesOnNegative
        metric = offload_to_cpu(RaisesOnNegative({exception!r}), worker={worker!r})
        metric.update(torch.ones(2))
        metric.update(-torch.ones(2))
        try:
            metric.compute()
        except BaseException as error:
            print(type(error).__name__, "|", error)
        metric.update(torch.ones(3))
        print(metric.compute().item())
        """)
    )
    name = exception.split("(")[0]
    assert out[0].startswith(
        f"{name} | RaisesOnNegative.update raised in lightning-store's offload worker, at update #2"
    )
    assert out[1] == "5.0"


class Plain(SumMetric):
    """A Metric of this module, which a worker process imports."""


class KeepsALock(SumMetric):
    def update(self, value: Tensor) -> None:
        self.cache = threading.Lock()  # pickle cannot take it
        super().update(value)


class _CannotCopyBack:
    def __reduce__(self):
        raise MemoryError("no memory to copy the states back")


class RunsOutOfMemory(SumMetric):
    def update(self, value: Tensor) -> None:
        self.scratch = _CannotCopyBack()
        if value.sum() < 0:
            raise MemoryError("the update's own allocation of 80 GiB failed")
        super().update(value)


class _TwoArguments(Exception):
    def __init__(self, code: int, detail: str) -> None:
        super().__init__(f"{code}: {detail}")
        self.code = code


class RaisesItsOwn(SumMetric):
    def update(self, value: Tensor) -> None:
        if value.sum() < 0:
            raise _TwoArguments(7, "negative")
        super().update(value)


class FailsAtTen(SumMetric):
    def update(self, value: Tensor) -> None:
        if value.item() == 10:
            raise ValueError("value 10 is refused")
        super().update(value)


def test_an_input_that_cannot_be_pickled_is_refused_at_the_call_and_nothing_waits_for_it(run):
    out = _out(
        run("""
        metric = offload_to_cpu(SumMetric(), worker="process")
        metric.update(torch.ones(2))
        try:
            metric.update(torch.ones(2), (i for i in range(3)))
        except TypeError as error:
            print(error)
        print(metric.compute().item(), metric._offload.pending)
        """)
    )
    assert out[0].startswith("SumMetric.update got an input that cannot be pickled (cannot pickle 'generator'")
    assert "HINT: pass tensors, numbers, strings" in out[0] and "or pass worker='thread'" in out[0]
    assert out[1] == "2.0 0"


def test_too_little_room_in_dev_shm_is_said_before_a_write_there_and_the_metric_goes_on(run):
    out = _out(
        run("""
        from lightning_store.metrics._offload.process import arena as _arena
        _arena._room = lambda: (2**20, 64 * 2**20)  # a Docker container's /dev/shm, nearly full
        metric = offload_to_cpu(CatMetric(), worker="process")
        metric.update(torch.ones(2))
        try:
            metric.update(torch.ones(2**20))  # 4 MiB
        except RuntimeError as error:
            print(error)
        print(metric.compute().tolist(), metric._offload.pending)
        _arena._room = lambda: (12 * 2**20, 64 * 2**20)  # room for one update's inputs, not for 4
        for value in range(3):
            metric.update(torch.full((2**20,), float(value)))
        print(metric.compute().sum().item(), _process_worker().space.arena.size)
        """)
    )
    assert out[0].startswith(
        "lightning-store's offload worker process takes an update's inputs through shared memory, in /dev/shm,"
        " which has 1.0 MiB free of 64.0 MiB: too little for the 4.0 MiB these inputs need"
    )
    assert "HINT: give the container more shared memory (`docker run --shm-size=8g`" in out[0]
    assert "or pass worker='thread' to offload_to_cpu" in out[0]
    assert out[1] == "[1.0, 1.0] 0"
    assert out[2] == f"{2.0 + 3 * 2**20:.1f} {4 * 2**20}"


@pytest.mark.parametrize(
    ("error", "hint"),
    [
        (
            "OSError(errno.EMFILE, 'Too many open files')",
            "this process has as many files open as it may: close some, or raise the limit (`ulimit -n`)",
        ),
        (
            "OSError(errno.EAGAIN, 'Resource temporarily unavailable')",
            "the system is short of memory or of processes: free memory, or end processes",
        ),
    ],
)
def test_a_worker_process_that_cannot_start_is_said_at_the_call_and_the_next_call_starts_one(run, error, hint):
    """A start that fails holds nothing: before, the pipe kept both ends here, and a large copy sent hung."""
    out = _out(
        run(f"""
        import errno, multiprocessing
        from multiprocessing import resource_tracker
        from torchmetrics.classification import MulticlassConfusionMatrix
        plain = MulticlassConfusionMatrix(300)
        offloaded = offload_to_cpu(MulticlassConfusionMatrix(300), worker="process")
        resource_tracker.ensure_running()  # started once, at the first shared memory: its pipe is no leak
        fds = len(os.listdir("/proc/self/fd"))
        spawned = multiprocessing.get_context("spawn").Process
        start, error = spawned.start, {error}
        def fails(process):
            raise error
        spawned.start = fails
        batch = torch.arange(2000) % 300, torch.arange(2000) % 7
        for _ in range(2):  # its copy (over 700 kB) is sent at each: it would fill the pipe
            try:
                offloaded.update(*batch)
            except RuntimeError as raised:
                print(raised, raised.__cause__ is error)
            print(len(os.listdir("/proc/self/fd")) - fds, _process_worker().conn)  # its pipe and shared memory closed
        spawned.start = start
        for m in (offloaded, plain):
            m.update(*batch)
        print(torch.equal(offloaded.compute(), plain.compute()), _process_worker().process.is_alive())
        """)
    )
    raised = eval(error, {"errno": errno})  # an OSError of errno EAGAIN is a BlockingIOError
    said = (
        f"lightning-store's offload worker process could not start ({type(raised).__name__}: {raised}). Nothing of"
        " this call was done: the Metric is as it was before it, and its next call starts the worker process again."
        f" HINT: {hint}; or pass worker='thread' to offload_to_cpu, which starts no process. True"
    )
    assert out == [said, "0 None", said, "0 None", "True True"]


@pytest.mark.parametrize("where", ["shm_open", "posix_fallocate's open"])
def test_shared_memory_that_cannot_be_made_is_said_at_the_call_and_the_next_call_makes_it(run, where):
    """With the worker process up, an update whose inputs need a new segment, and no descriptor left to make it."""
    out = _out(
        run(f"""
        import errno
        from multiprocessing import shared_memory
        from lightning_store.metrics._offload.process import arena as _arena
        from torchmetrics.classification import MulticlassConfusionMatrix
        plain = MulticlassConfusionMatrix(300)
        offloaded = offload_to_cpu(MulticlassConfusionMatrix(300), worker="process")
        small = torch.arange(40) % 300, torch.arange(40) % 7  # 640 bytes: with the message, in no segment
        for m in (offloaded, plain):
            m.update(*small)
        offloaded.compute()  # the worker process is up, and no segment made yet
        fds, shm = len(os.listdir("/proc/self/fd")), set(os.listdir("/dev/shm"))
        error = OSError(errno.EMFILE, "Too many open files")
        def fails(*args, **kwargs):
            raise error
        made, opened = shared_memory.SharedMemory, os.open
        if {where!r} == "shm_open":
            _arena.shared_memory.SharedMemory = fails
        else:
            _arena.os.open = lambda path, *a: fails() if path.startswith("/dev/shm/") else opened(path, *a)
        large = torch.arange(2000) % 300, torch.arange(2000) % 7
        try:
            offloaded.update(*large)
        except RuntimeError as raised:
            print(raised, raised.__cause__ is error)
        print(len(os.listdir("/proc/self/fd")) - fds, sorted(set(os.listdir("/dev/shm")) - shm))
        _arena.shared_memory.SharedMemory, _arena.os.open = made, opened
        for m in (offloaded, plain):
            m.update(*large)
        print(torch.equal(offloaded.compute(), plain.compute()), int(plain.compute().sum()))
        """)
    )
    assert out == [
        "lightning-store's offload worker process takes an update's inputs through shared memory, and a segment of"
        " 16.0 MiB for them could not be made (OSError: [Errno 24] Too many open files). Nothing of this call was"
        " done: the Metric is as it was before it, and its next call tries again. HINT: this process has as many"
        " files open as it may: close some, or raise the limit (`ulimit -n`); or pass worker='thread' to"
        " offload_to_cpu, which needs no shared memory. True",
        "0 []",
        "True 2040",
    ]


def test_an_update_interrupted_before_it_is_queued_hands_back_what_it_took(monkeypatch):
    """Ctrl-C while an update waits for room: its inputs' device copies are released, and the next update runs."""
    from lightning_store.metrics._offload.process import inputs as _inputs
    from lightning_store.metrics._offload.process.arena import _Space

    released = []
    release = _inputs._Outgoing.release
    monkeypatch.setattr(_inputs._Outgoing, "release", lambda self: released.append(self) or release(self))
    plain, offloaded = SumMetric(), offload_to_cpu(SumMetric(), worker="process")
    large = torch.arange(1000.0)  # 8 kB: in shared memory, not with the message
    for metric in (plain, offloaded):
        metric.update(large)
    take = _Space.take

    def interrupted(self, nbytes, wait):
        raise KeyboardInterrupt

    monkeypatch.setattr(_Space, "take", interrupted)
    with pytest.raises(KeyboardInterrupt):
        offloaded.update(large + 1)
    assert len(released) == 1
    monkeypatch.setattr(_Space, "take", take)
    for metric in (plain, offloaded):
        metric.update(large + 2)
    assert torch.equal(offloaded.compute(), plain.compute())
    assert len(released) == 1


def test_a_worker_thread_that_cannot_start_is_said_at_the_call_and_the_next_call_starts_one(run):
    """Before, the thread not started was kept, taken at the next read for one that ended: said a bug, for ever."""
    out = _out(
        run("""
        offloaded, plain = offload_to_cpu(SumMetric(), worker="thread"), SumMetric()
        start = threading.Thread.start
        def fails(thread):
            if thread.name != "lightning-store-offload":
                return start(thread)
            raise RuntimeError("can't start new thread")  # what Python raises, out of memory or of threads
        threading.Thread.start = fails
        for _ in range(2):
            try:
                offloaded.update(torch.ones(3))
            except RuntimeError as error:
                print(error)
        threading.Thread.start = start
        for m in (offloaded, plain):
            m.update(torch.full((2,), 2.0))
        print(offloaded.compute().item(), plain.compute().item())
        """)
    )
    said = (
        "lightning-store's offload worker thread could not start (can't start new thread). Nothing of this call was"
        " done: the Metric is as it was before it, and its next call starts the worker thread again. HINT: the system"
        " is short of memory or of threads: free memory, or end threads or processes; or keep the Metric as it is"
        " (not offloaded)."
    )
    assert out == [said, said, "4.0 4.0"]


def test_an_update_that_waited_for_room_as_its_worker_process_ended_is_not_sent_if_no_new_one_starts(run):
    """Its call raises that no worker process could start: the update must not run when one does, later."""
    out = _out(
        run("""
        import errno, multiprocessing
        from faulty import Slow
        slow, plain = offload_to_cpu(Slow(), worker="process"), SumMetric()
        offloaded = offload_to_cpu(SumMetric(), worker="process")
        for m in (offloaded, plain):
            m.update(torch.ones(1))
        print(offloaded.compute().item())  # read back: nothing of it is left to lose
        big = torch.ones(2**20)  # 4 MiB: 4 of them in flight fill the inputs' shared memory (16 MiB)
        for _ in range(4):
            slow.update(big)
        worker = _process_worker()
        threading.Timer(0.3, worker.process.kill).start()  # while the next update waits for room
        spawned = multiprocessing.get_context("spawn").Process
        start = spawned.start
        def fails(process):
            raise OSError(errno.EAGAIN, "Resource temporarily unavailable")
        spawned.start = fails
        try:
            offloaded.update(big)
        except RuntimeError as error:
            print(str(error).split(" (")[0])
        spawned.start = start
        for m in (offloaded, plain):
            m.update(torch.full((1,), 2.0))
        print(offloaded.compute().item(), plain.compute().item())
        """)
    )
    assert out == ["1.0", "lightning-store's offload worker process could not start", "3.0 3.0"]


def test_a_process_out_of_file_descriptors_is_told_so_and_never_hangs(run):
    """With from none to a score of descriptors left, each update runs or raises (none waits), and none is lost."""
    out = _out(
        run("""
        import resource
        from torchmetrics.classification import MulticlassConfusionMatrix
        offloaded = offload_to_cpu(MulticlassConfusionMatrix(300), worker="process")
        plain = MulticlassConfusionMatrix(300)
        batch = torch.arange(2000) % 300, torch.arange(2000) % 7
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
        said = set()
        for left in range(24):
            held = []
            with contextlib.suppress(OSError):
                while True:
                    held.append(os.open(os.devnull, os.O_RDONLY))
            for fd in held[len(held) - left:]:
                os.close(fd)
            try:
                offloaded.update(*batch)
                said.add("ran")
            except RuntimeError as error:
                said.add(str(error).split(" HINT")[0].split("(")[0].split(" of ")[0])
            except OSError as error:
                said.add(f"OSError {error.errno}")
            else:
                plain.update(*batch)
            for fd in held[: len(held) - left]:
                os.close(fd)
        print(sorted(said))
        print(torch.equal(offloaded.compute(), plain.compute()), int(plain.compute().sum()))
        """)
    )
    said = set(ast.literal_eval(out[0]))
    cannot_start = "lightning-store's offload worker process could not start "
    no_segment = (
        "lightning-store's offload worker process takes an update's inputs through shared memory, and a segment"
    )
    assert {cannot_start, "ran"} <= said <= {cannot_start, "ran", no_segment}
    equal, total = out[1].split()
    assert equal == "True" and int(total) > 0


def test_a_worker_process_killed_after_a_read_is_replaced_and_given_the_state_held_here():
    offloaded, plain = offload_to_cpu(SumMetric(), worker="process"), SumMetric()
    for m in (offloaded, plain):
        m.update(torch.ones(2))
    assert offloaded.compute() == plain.compute()
    _process_worker().process.kill()  # as the out-of-memory killer would
    _process_worker().process.join(10)
    for m in (offloaded, plain):
        m.update(torch.full((3,), 2.0))
        m.update(torch.full((3,), 4.0))
    assert offloaded.compute() == plain.compute() == 20.0
    assert _process_worker().process.is_alive()


def test_a_worker_process_killed_with_updates_not_read_back_is_said_by_its_signal():
    offloaded = offload_to_cpu(Plain(), worker="process")
    offloaded.update(torch.ones(2))
    _process_worker().flush()
    os.kill(_process_worker().process.pid, signal.SIGKILL)
    _process_worker().process.join(10)
    with pytest.raises(
        RuntimeError,
        match=r"^Plain: lightning-store's offload worker process ended \(killed by signal SIGKILL, which the system's"
        r" out-of-memory killer sends, as does `kill -9`\)\. The updates sent to it since .* are lost: .*"
        r" HINT: give the job more memory",
    ) as err:
        offloaded.compute()
    _assert_no_guard_hint_and_going_on_after_reset(offloaded, err.value)


def _assert_no_guard_hint_and_going_on_after_reset(offloaded, error):
    assert "__main__" not in str(error)  # it had started: no hint about a script's guard
    offloaded.reset()
    offloaded.update(torch.ones(3))
    assert offloaded.compute() == 3.0


def test_a_worker_process_that_ended_on_an_error_is_said_with_the_error():
    offloaded = offload_to_cpu(Plain(), worker="process")
    offloaded.update(torch.ones(2))
    _process_worker().send_bytes(pickle.dumps(("no such message",)))  # the worker process raises, and ends
    with pytest.raises(
        RuntimeError,
        match=r"^Plain: lightning-store's offload worker process ended \(exit code 1\)\. Its last exception:"
        r" ValueError: not a message of lightning-store's offload worker: \('no such message',\)\.",
    ) as err:
        offloaded.compute()
    _assert_no_guard_hint_and_going_on_after_reset(offloaded, err.value)


def test_an_attribute_an_update_sets_that_cannot_be_pickled_is_named_and_the_worker_goes_on():
    offloaded = offload_to_cpu(KeepsALock(), worker="process")
    offloaded.update(torch.ones(2))
    pid = _process_worker().process.pid
    with pytest.raises(
        RuntimeError,
        match=r"^KeepsALock: its states could not be copied back from the worker process: an update set cache"
        r" \(lock\), which cannot be pickled \(TypeError: cannot pickle '_thread.lock' object\)\..* HINT: keep only"
        r" picklable attributes on the Metric .*or pass worker='thread' to offload_to_cpu",
    ):
        offloaded.compute()
    assert _process_worker().process.pid == pid and _process_worker().process.is_alive()


def test_an_allocation_error_of_the_update_is_not_hidden_by_one_while_the_states_are_copied_back():
    offloaded = offload_to_cpu(RunsOutOfMemory(), worker="process")
    offloaded.update(torch.ones(2))
    offloaded.update(-torch.ones(2))
    with pytest.raises(
        RuntimeError,
        match=r"^RunsOutOfMemory: its states could not be copied back from the worker process \(MemoryError: no"
        r" memory to copy the states back\)\. Before that, update #2 raised MemoryError: the update's own allocation"
        r" of 80 GiB failed\.",
    ) as err:
        offloaded.compute()
    assert isinstance(err.value.__cause__, MemoryError)
    assert _process_worker().process.is_alive()


def test_a_class_from_python_c_is_refused_at_once_with_the_thread_worker_as_the_fix():
    script = PRELUDE + textwrap.dedent("""
    class Mine(SumMetric):
        pass
    try:
        offload_to_cpu(Mine(), worker="process")
    except TypeError as error:
        print(error)
    metric = offload_to_cpu(Mine(), worker="thread")  # the thread worker works here
    metric.update(torch.ones(2))
    print(metric.compute().item())
    """)
    out = _out(_bounded([sys.executable, "-c", script]))
    assert out[0].startswith(
        "offload_to_cpu(worker='process') got a Mine whose class Mine is defined in `__main__` of a program run with"
        " `python -c`, from stdin or in a notebook: the worker process cannot import it. HINT: pass worker='thread'"
    )
    assert out[1] == "2.0"


def test_a_program_read_from_stdin_is_told_the_worker_process_cannot_start_there():
    script = PRELUDE + textwrap.dedent("""
    metric = offload_to_cpu(SumMetric(), worker="process")
    try:
        metric.update(torch.ones(2))
    except RuntimeError as error:
        print(error)
    print(metric.compute().item())
    """)
    out = _out(_bounded([sys.executable, "-"], input=script))
    assert out[0].startswith(
        "lightning-store's offload worker process cannot start: it starts as DataLoader workers do with the `spawn`"
        " method, which runs this program's `__main__` again, and this one was read from <stdin>, which another"
        " process cannot read. HINT: pass worker='thread'"
    )
    assert out[1] == "0.0"


def test_an_attribute_set_after_offloading_that_cannot_be_pickled_is_said_with_the_metric_and_a_hint():
    offloaded = offload_to_cpu(Plain(), worker="process")
    offloaded.update(torch.ones(2))
    assert offloaded.compute() == 2.0
    offloaded.transform = lambda x: x
    with pytest.raises(
        TypeError,
        match=r"^Plain cannot be pickled any more \(.*\), and the worker process gets a copy of it .* HINT: keep only"
        r" picklable attributes on the Metric, or pass worker='thread' to offload_to_cpu\.",
    ):
        offloaded.update(torch.ones(2))
    del offloaded.transform
    offloaded.update(torch.ones(2))
    assert offloaded.compute() == 4.0


@pytest.mark.parametrize("worker", ["thread", "process"])
def test_an_update_that_fails_is_raised_at_one_of_the_next_calls_once_its_answer_is_there(worker):
    offloaded = offload_to_cpu(FailsAtTen(), worker=worker, max_pending=64)
    offloaded.update(torch.tensor(0.0))
    assert offloaded.compute() == 0.0  # the worker is up: what follows counts the answer's lag, not its start
    raised_at = None
    for call in range(1, 61):
        try:
            offloaded.update(torch.tensor(float(call)))
        except ValueError:
            raised_at = call
            break
        time.sleep(0.05)  # a training step
    assert raised_at is not None and raised_at <= 30, raised_at  # the thread: at call 11; 64 calls late before
    offloaded.reset()


@pytest.mark.parametrize("worker", ["thread", "process"])
def test_an_error_whose_constructor_takes_other_arguments_keeps_its_type(worker):
    offloaded = offload_to_cpu(RaisesItsOwn(), worker=worker)
    offloaded.update(torch.ones(2))
    offloaded.update(-torch.ones(2))
    with pytest.raises(_TwoArguments, match=r"^7: negative$") as err:
        offloaded.compute()
    assert err.value.code == 7
    assert offloaded.compute() == 2.0


@pytest.mark.parametrize("read_first", [True, False], ids=["once it runs", "while it starts"])
def test_ctrl_c_to_the_process_group_leaves_the_worker_process_quiet_and_up(tmp_path, read_first):
    script = tmp_path / "interrupted.py"
    script.write_text(
        PRELUDE
        + textwrap.dedent(f"""
        if __name__ == "__main__":
            metric = offload_to_cpu(SumMetric(), worker="process")
            metric.update(torch.ones(2))  # returns at once: the worker process starts, importing torch for seconds
            if {read_first}:
                metric.compute()  # waits until it runs
            print("ready", flush=True)
            try:
                time.sleep(60)
            except KeyboardInterrupt:
                print("interrupted", flush=True)
            metric.update(torch.ones(2))
            print(metric.compute().item(), flush=True)
        """)
    )
    process = subprocess.Popen(
        [sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        assert process.stdout.readline() == "ready\n"
        time.sleep(0.5)
        os.killpg(process.pid, signal.SIGINT)  # as Ctrl-C in a terminal
        out, err = process.communicate(timeout=HANG_BOUND_S)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
    assert out.splitlines() == ["interrupted", "4.0"], err
    assert "KeyboardInterrupt" not in err and "Traceback" not in err, err


def test_the_worker_process_ends_once_no_offloaded_object_is_left(run):
    out = _out(
        run("""
        _parent._IDLE_S = 0.2
        metric = offload_to_cpu(SumMetric(), worker="process")
        metric.update(torch.ones(2))
        print(metric.compute().item())
        process = _process_worker().process
        del metric
        gc.collect()
        deadline = time.monotonic() + 30
        while process.is_alive() and time.monotonic() < deadline:  # the worker's own timer joins it
            time.sleep(0.1)
        print(process.is_alive(), _process_worker().process)
        metric = offload_to_cpu(SumMetric(), worker="process")  # a new worker process
        metric.update(torch.ones(3))
        print(metric.compute().item())
        """)
    )
    assert out == ["2.0", "False None", "3.0"]


def test_a_script_without_the_main_guard_is_told_so_before_anything_runs_again(tmp_path):
    script = tmp_path / "unguarded.py"
    text = PRELUDE + textwrap.dedent("""
        metric = offload_to_cpu(SumMetric(), worker="process")
        try:
            metric.update(torch.ones(2))
        except RuntimeError as error:
            print(error)
        print(_process_worker().process)
        metric.update(torch.ones(3))  # raises the same, uncaught
        """)
    script.write_text(text)
    out = _bounded([sys.executable, str(script)], cwd=tmp_path)
    line = text.splitlines().index("try:") + 1
    lines = out.stdout.splitlines()
    assert lines[0] == (
        "lightning-store's offload worker process cannot start: it starts as DataLoader workers do with the `spawn`"
        f" method, which runs this program's `__main__` module again, and the statement at line {line} of {script},"
        " which led to this update, is not under `if __name__ == '__main__':`: the worker process would run it"
        " again. HINT: put the script's code under `if __name__ == '__main__':`, or pass worker='thread' to"
        " offload_to_cpu."
    ), out.stderr[-3000:]
    assert lines[1] == "None"  # no worker process was started: nothing of the script ran again
    last = len(text.rstrip().splitlines())  # the update after it, uncaught, names its own statement
    assert out.returncode == 1
    assert f"RuntimeError: {lines[0].replace(f'line {line} ', f'line {last} ')}" in out.stderr


# the edit adds lines above the running `main()` call: looked up in the file as it is then, its line falls in `main`
EDITED_WHILE_IT_RUNS = """\
    with open(__file__) as file:
        text = file.read()
    with open(__file__, "w") as file:
        file.write("# edited\\n" * 8 + text)
"""


@pytest.mark.parametrize("edit", ["", EDITED_WHILE_IT_RUNS], ids=["as written", "edited while it runs"])
def test_a_script_whose_code_runs_under_the_main_guard_starts_its_worker_process(tmp_path, edit):
    script = tmp_path / "guarded.py"
    script.write_text(
        PRELUDE
        + textwrap.dedent("""
        def main():
            metric = offload_to_cpu(SumMetric(), worker="process")
            metric.update(torch.ones(2))
            print(metric.compute().item())


        if __name__ == "__main__":
        """)
        + textwrap.indent(textwrap.dedent(edit), "    ")
        + "    main()\n"
    )
    out = _bounded([sys.executable, str(script)], cwd=tmp_path)
    assert out.stdout.splitlines() == ["2.0"], out.stderr[-3000:]
    if edit:  # it was edited before the worker process started
        assert script.read_text().startswith("# edited\n" * 8)


def test_the_worker_process_ends_soon_after_its_parent_though_another_process_keeps_the_pipe_open(run):
    result = run("""
        import subprocess
        metric = offload_to_cpu(SumMetric(), worker="process")
        metric.update(torch.ones(2))
        metric.compute()
        holder = subprocess.Popen(  # a process started with this one's end of the pipe, which it keeps open
            ["sleep", "90"],
            pass_fds=[_process_worker().conn.fileno()],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        print(holder.pid, time.time(), flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
        """)
    ended = time.time()  # the worker process held this run's output: it has ended
    holder, killed = result.stdout.split()
    with contextlib.suppress(ProcessLookupError):
        os.kill(int(holder), signal.SIGKILL)
    assert result.returncode == -signal.SIGKILL
    assert ended - float(killed) < 45  # it watches its parent every 5 s; before, it waited for the pipe's end (90 s)


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="POSIX shared memory shows in /dev/shm on Linux")
def test_a_process_group_killed_together_leaves_nothing_in_dev_shm(tmp_path):
    # a closed terminal, or `kill -9` to the group, ends the resource tracker too, which would remove the names
    script = tmp_path / "killed.py"
    script.write_text(
        PRELUDE
        + textwrap.dedent("""
        if __name__ == "__main__":
            metric = offload_to_cpu(SumMetric(), worker="process")
            metric.update(torch.ones(100_000))  # its inputs go through an arena
            metric.compute()
            worker = _process_worker()
            print(worker.progress.name, worker.space.arena.name, flush=True)
            os.killpg(0, signal.SIGKILL)
        """)
    )
    result = _bounded([sys.executable, str(script)], cwd=tmp_path, start_new_session=True)
    assert result.returncode == -signal.SIGKILL, result.stderr[-3000:]
    names = result.stdout.split()
    left = [name for name in names if os.path.exists(os.path.join("/dev/shm", name))]
    for name in left:  # not left behind by this test, whatever it finds
        os.unlink(os.path.join("/dev/shm", name))
    assert len(names) == 2 and left == []


def test_a_wait_for_a_worker_thread_that_ended_raises_rather_than_hangs(run):
    out = _out(
        run("""
        from lightning_store.metrics._offload.thread.worker import _WorkerThread
        _WorkerThread.liveness_s = 0.2
        _WorkerThread._loop = lambda self: None  # a thread that ends at once, as if by a bug
        metric = offload_to_cpu(SumMetric(), worker="thread")
        metric.update(torch.ones(2))
        try:
            metric.compute()
        except RuntimeError as error:
            print(error)
        """)
    )
    assert out[0].startswith("lightning-store's offload worker thread ended with 1 job(s) not run")
