"""Busy fraction over a sliding window, from the time a role spent waiting for work."""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable

_MARK_EVERY_S = 1.0


class BusyMeter:
    """`fraction()` = 1 - waiting / elapsed over roughly the last `window_s` seconds.

    Waits are credited when they end (a role's `get` returns), so a wait in progress counts as
    busy until then; roles wait at most a poll interval at a time, far below the window.
    """

    def __init__(self, window_s: float = 10.0, clock: Callable[[], float] = time.monotonic):
        self._window_s = window_s
        self._clock = clock
        self._lock = threading.Lock()
        self._waited = 0.0
        self._marks: deque[tuple[float, float]] = deque([(clock(), 0.0)])

    def waited(self, seconds: float) -> None:
        with self._lock:
            self._waited += max(0.0, seconds)
            self._mark(self._clock())

    def fraction(self) -> float:
        with self._lock:
            now = self._clock()
            self._mark(now)
            start, waited_then = self._marks[0]
            elapsed = now - start
            if elapsed <= 0:
                return 0.0
            return min(1.0, max(0.0, 1.0 - (self._waited - waited_then) / elapsed))

    def _mark(self, now: float) -> None:
        if now - self._marks[-1][0] >= _MARK_EVERY_S:
            self._marks.append((now, self._waited))
        # Keep the newest mark at or before the window's start as the baseline.
        while len(self._marks) > 1 and self._marks[1][0] <= now - self._window_s:
            self._marks.popleft()
