"""The stop event of one experiment run: set by the experiment's own (Ctrl-C), or when the run
no longer publishes versions.

The embedded runner sets its stop event itself when the job ends; the experiment's event must
survive that, and still reach the run in progress, so each run gets a fresh one. Why a run
that publishes nothing for `stall_s` is stopped: CONTRIBUTING.md, "Adding an experiment".
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
def run_stop(
    parent: threading.Event,
    stall_s: float = 0.0,
    *,
    on_stall: Callable[[], None] = lambda: None,
    clock: Callable[[], float] = time.monotonic,
    poll_s: float = 0.2,
) -> Iterator[tuple[threading.Event, Heartbeat]]:
    """A fresh event for one run, set once `parent` is, and a `Heartbeat` to feed the run's
    records: the event is also set (after `on_stall()`) once no record has come for
    `stall_s` seconds. `stall_s <= 0` watches no records."""
    stop, beat, done = threading.Event(), Heartbeat(clock), threading.Event()

    def watch() -> None:
        while not done.is_set() and not stop.is_set():
            if parent.wait(poll_s):
                stop.set()
            elif stall_s > 0 and beat.idle_s() >= stall_s:
                on_stall()
                stop.set()

    thread = threading.Thread(target=watch, name="experiment-run-stop", daemon=True)
    thread.start()
    try:
        yield stop, beat
    finally:
        done.set()
        thread.join()
