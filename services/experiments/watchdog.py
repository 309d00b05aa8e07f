"""Stop an experiment run that no longer publishes versions.

A synchronous job whose model has diverged publishes no version again: every client refuses to
send an update holding NaN, the round gets no update and reopens, until
`rounds.max_empty_attempts` empty attempts (each twice the round deadline) fail the job. An
experiment must still finish and report the rounds it got, and sooner, so a run that publishes
nothing for `stall_s` seconds is stopped (its status is then "stopped", its records kept).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from services.report.records import VersionRecord


class Heartbeat:
    """A metrics sink that notes when the last version was published (or when it was made)."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self.last = clock()

    def record(self, record: VersionRecord) -> None:
        self.last = self._clock()

    def finish(self, status: str) -> None:
        pass

    def idle_s(self) -> float:
        return self._clock() - self.last


@contextmanager
def watchdog(
    stop: threading.Event,
    stall_s: float,
    *,
    on_stall: Callable[[], None] = lambda: None,
    clock: Callable[[], float] = time.monotonic,
    poll_s: float = 1.0,
) -> Iterator[Heartbeat]:
    """A `Heartbeat` to feed the run's records; sets `stop` (after `on_stall()`) once no record
    has come for `stall_s` seconds. `stall_s <= 0` watches nothing."""
    beat = Heartbeat(clock)
    if stall_s <= 0:
        yield beat
        return
    done = threading.Event()

    def watch() -> None:
        while not done.wait(poll_s):
            if stop.is_set():
                return
            if beat.idle_s() >= stall_s:
                on_stall()
                stop.set()
                return

    thread = threading.Thread(target=watch, name="experiment-watchdog", daemon=True)
    thread.start()
    try:
        yield beat
    finally:
        done.set()
        thread.join()
