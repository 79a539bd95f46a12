"""Whether offloading a Metric costs its caller's step more than it saves: measured at its calls and in the worker."""

import statistics

WINDOW = 50  # updates compared at once, after the first few
WARM_UP = 5  # the first updates, which start the worker and make what torch makes once


class _Payoff:
    """The medians, over a window of updates, of what handing an update to the worker costs the step and saves it.

    - ``handoff_s``: the caller's time in the ``update`` call (copies, the caller's state, the queue), less any
      wait for room in the queue (which the queue's lag reports);
    - ``saved_s``: the update's own work that ran in the worker: its torch ops' CPU time in a worker thread, the
      whole ``update`` call in a worker process;
    - ``held_s``: a worker thread's Python time around those ops (the guard, the caller's state, the update's own
      Python code), which holds the interpreter a step that runs Python (a GPU host launching kernels) waits for:
      the thread's CPU time less its ops' time, so that a wait for the interpreter is not counted as holding it.
      An upper bound: the C++ work between the ops the guard sees (a composite op's own) counts in it too.

    Offloading costs the step more than it saves when ``handoff_s + held_s >= saved_s``: :meth:`called` returns
    the message that says so, with the figures, the first time a window shows it. The caller's thread calls
    :meth:`called`; the worker's answers, :meth:`ran` (a worker thread's appends race with nothing: a window is
    swapped out whole, and a figure that lands in the old one is not counted).
    """

    __slots__ = ("calls", "last", "runs", "seen_calls", "seen_runs", "told")

    def __init__(self) -> None:
        self.calls: list[float] = []
        self.runs: list[tuple[float, float]] = []
        self.seen_calls = self.seen_runs = 0
        self.told = False
        self.last: tuple[float, float, float] | None = None  # the latest window's medians: hand-off, saved, held

    def ran(self, saved_s: float, held_s: float = 0.0) -> None:
        """Count an update run in the worker: the work it moved off the step, and the interpreter time it held."""
        self.seen_runs += 1
        if self.seen_runs > WARM_UP and not self.told:
            self.runs.append((saved_s, held_s))

    def called(self, handoff_s: float, name: str, worker: str) -> str | None:
        """Count an update's call (``handoff_s``: its time in the caller); the message, once, if it does not pay."""
        self.seen_calls += 1
        if self.told or self.seen_calls <= WARM_UP:
            return None
        self.calls.append(handoff_s)
        if len(self.calls) < WINDOW or len(self.runs) < WINDOW:
            return None
        calls, self.calls = self.calls, []
        runs, self.runs = self.runs, []
        handoff = statistics.median(calls)
        saved = statistics.median(saved for saved, _ in runs)
        held = statistics.median(held for _, held in runs)
        self.last = (handoff, saved, held)
        if handoff + held < saved:
            return None
        self.told = True
        held_part = (
            f", and the worker thread held Python's interpreter up to {_ms(held)} around it (time a step that runs"
            " Python, as one launching GPU kernels does, waits for)"
            if worker == "thread"
            else ""
        )
        return (
            f"{name}: offloading it costs the step more than it saves. Over the last {len(calls)} updates"
            f" (medians), handing one to the {worker} worker took {_ms(handoff)} of the step{held_part}, against"
            f" {_ms(saved)} of the update's own work moved off the step. HINT: keep this Metric as it is (not"
            " offloaded): offloading pays for a Metric whose update takes well over the hand-off, which"
            " `python -m lightning_store` measures on this machine."
        )


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f} ms"
