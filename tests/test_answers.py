"""The worker process's answers: a small one written at once, a large one by a thread, never waiting, in order."""

import multiprocessing
import sys
import time

import pytest

from lightning_store.metrics._offload.process import messages
from lightning_store.metrics._offload.process.answers import _AT_ONCE_BYTES, _Answers

pytestmark = [
    pytest.mark.skipif(sys.platform == "win32", reason="every answer goes through the thread on Windows"),
    pytest.mark.no_lightning,  # no Lightning here: not run again on each Lightning minor (.ci/run)
]


def _read_all(conn, count):
    return [messages._read(conn.recv()) for _ in range(count)]


@pytest.fixture
def pipe():
    """An ``_Answers`` on one end of a pipe, and the other end, read by the test; closed after it."""
    ours, theirs = multiprocessing.Pipe()
    answers = _Answers(ours)
    yield answers, theirs
    answers.close(5)
    ours.close()
    theirs.close()


def test_a_small_answer_is_written_at_once_without_the_thread(pipe):
    answers, theirs = pipe
    answers.put(messages._Ran([(1, 1, None, [], [], False, True, 0.5)]))
    assert answers.with_thread == 0 and answers.queue.empty()  # not handed to the thread
    assert theirs.poll(0)  # there already
    assert _read_all(theirs, 1) == [messages._Ran([(1, 1, None, [], [], False, True, 0.5)])]


def test_answers_after_one_the_pipe_cannot_take_wait_for_it_in_order_and_the_caller_never_waits(pipe):
    answers, theirs = pipe
    large = messages._States(7, b"x" * (8 * 2**20), None)  # far more than a pipe holds: its writer waits for a read
    started = time.perf_counter()
    answers.put(large)
    for number in range(1, 51):  # small, but after one still being written: they go after it
        answers.put(messages._Ran([(7, number, None, [], [], False, True, 0.0)]))
    assert time.perf_counter() - started < 5  # nothing here waited for the pipe (nothing reads it yet)
    assert answers.with_thread == 51
    got = _read_all(theirs, 51)
    assert got[0] == large
    assert [ran.done[0][1] for ran in got[1:]] == list(range(1, 51))
    deadline = time.monotonic() + 10
    while answers.with_thread and time.monotonic() < deadline:  # the thread counts each once written
        time.sleep(0.01)
    assert answers.with_thread == 0
    answers.put(messages._Ready())  # the thread is through: written at once again
    assert answers.queue.empty() and _read_all(theirs, 1) == [messages._Ready()]


def test_an_answer_too_large_to_be_written_at_once_arrives_whole(pipe):
    answers, theirs = pipe
    states = messages._States(3, b"y" * (_AT_ONCE_BYTES + 1), None)
    answers.put(states)
    assert _read_all(theirs, 1) == [states]
