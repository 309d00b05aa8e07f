"""How busy a worker is: the share of wall time it spent on anything but waiting for a
delivery, which the autoscaler reads from its heartbeat (docs/deployment.md, "Autoscaling
workers": why queue depth alone cannot tell).
"""

from __future__ import annotations

from collections.abc import Callable


class BusyMeter:
    """Accumulates waiting time; `take` turns a window of it into a busy fraction."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._since = clock()
        self._waited = 0.0
        self._last: float | None = None

    def waited(self, seconds: float) -> None:
        """A wait that ended now; only its part inside the window counts (a poll that began
        before the last `take` would otherwise push an idle window's waiting past its length)."""
        self._waited += min(max(0.0, seconds), max(0.0, self._clock() - self._since))

    def take(self, min_window_s: float = 0.0) -> float | None:
        """The busy fraction since the previous `take`, then a new window starts. A window
        shorter than `min_window_s` says too little (a worker just started is "busy" loading
        its replicas): the previous fraction instead (None until there is one), the window
        goes on."""
        now = self._clock()
        elapsed = now - self._since
        if elapsed <= 0 or elapsed < min_window_s:
            return self._last
        fraction = min(1.0, max(0.0, 1.0 - self._waited / elapsed))
        self._since, self._waited, self._last = now, 0.0, fraction
        return fraction
