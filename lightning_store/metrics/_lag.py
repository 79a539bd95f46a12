"""Whether an offloaded Metric's worker keeps up with the calls: counted at each ``update``, said once if not."""

WINDOW = 50  # updates: the worker falls behind when at least half of a window's calls waited for room


class _Lag:
    """The calls of one queue that waited for room (``max_pending`` updates already waiting), by window of calls.

    A call that waits means the worker runs the Metric's updates slower than they come: the step then waits for the
    Metric's work anyway, and pays the copies besides. Once a window has at least half of its calls waiting, the
    worker is behind (``behind``), and :meth:`count` returns the message that says so, the first time only.
    """

    __slots__ = ("behind", "calls", "told", "waited_s", "waits")

    def __init__(self) -> None:
        self.calls = self.waits = 0
        self.waited_s = 0.0
        self.behind = self.told = False

    def count(self, waited_s: float | None, name: str, max_pending: int) -> str | None:
        """Count a call (``waited_s``: how long it waited for room, ``None`` if it did not); the message, once."""
        self.calls += 1
        if waited_s is not None:
            self.waits += 1
            self.waited_s += waited_s
        if self.calls < WINDOW:
            return None
        calls, waits, waited_s = self.calls, self.waits, self.waited_s
        self.calls = self.waits = 0
        self.waited_s = 0.0
        self.behind = 2 * waits >= calls
        if not self.behind or self.told:
            return None
        self.told = True
        return (
            f"{name}: its offload worker falls behind: `update` waited for room in the queue at {waits} of the last"
            f" {calls} calls ({waited_s:.3f} s in all). The step waits for the Metric's work anyway, and pays the"
            " copies of its inputs besides, so offloading costs the step more than it saves. HINT: keep this Metric"
            " as it is (not offloaded), or update it less often; if the calls come in bursts, a larger max_pending"
            f" (now {max_pending}) absorbs them."
        )
