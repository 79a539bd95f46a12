"""The worker process's messages to its parent, in order: a small one written at once, a large one by a thread.

An answer waits for nothing here: the parent may be writing a large message (a Metric's copy) and read nothing
until it is through, so a write that would wait on a full pipe goes to a thread of its own, and this process goes
on reading. A small answer (a run of updates done, most often) is written at once where the pipe has room and no
earlier message is still with the thread: handed to a thread, it waits for that thread to be scheduled and to take
the interpreter lock from the updates running here, which on a 2-core machine took 140 µs, and the parent, which
waits for room in the queue, waits that long too.
"""

import contextlib
import pickle
import queue
import select
import threading
from typing import Any

from lightning_store.metrics._offload.process.messages import _wire

# at most, for a message written at once: a write this small to a pipe that has room does not wait (PIPE_BUF), and
# a socket that polls writable has room for far more
_AT_ONCE_BYTES = 4096


class _Answers:
    """Send the messages of the worker process on ``conn`` in the order given, never waiting on a full pipe."""

    def __init__(self, conn: Any) -> None:
        self.conn = conn
        self.lock = threading.Lock()
        self.with_thread = 0  # messages handed to the thread and not written yet: a message after them waits too
        self.queue: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        self.poller: Any = None
        if hasattr(select, "poll"):  # not on Windows: every message goes through the thread there
            self.poller = select.poll()
            self.poller.register(conn.fileno(), select.POLLOUT)
        self.thread = threading.Thread(target=self._write_all, name="lightning-store-answers", daemon=True)
        self.thread.start()

    def put(self, message: Any) -> None:
        """Send ``message`` (one of ``messages``') after those put before it (from this process's main thread)."""
        payload = pickle.dumps(_wire(message), pickle.HIGHEST_PROTOCOL)
        with self.lock:
            at_once = self.with_thread == 0 and len(payload) <= _AT_ONCE_BYTES and self._room()
            if not at_once:
                self.with_thread += 1
        if not at_once:
            self.queue.put(payload)
            return
        with contextlib.suppress(OSError, ValueError):  # the parent is gone: this process ends at its next read
            self.conn.send_bytes(payload)

    def _room(self) -> bool:
        return self.poller is not None and bool(self.poller.poll(0))

    def _write_all(self) -> None:
        while (payload := self.queue.get()) is not None:
            try:
                self.conn.send_bytes(payload)
            except (OSError, ValueError):
                return
            with self.lock:
                self.with_thread -= 1

    def close(self, timeout_s: float) -> None:
        """Let the thread write what it holds, waiting at most ``timeout_s``; then it ends."""
        self.queue.put(None)
        self.thread.join(timeout_s)
