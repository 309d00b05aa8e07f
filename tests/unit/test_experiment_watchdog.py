"""A run's stop event: the experiment's reaches it but not back, and a run that publishes no
version for `stall_s` is stopped."""

from __future__ import annotations

import threading

from services.experiments.watchdog import run_stop
from services.report.records import VersionRecord


def record() -> VersionRecord:
    nan = float("nan")
    return VersionRecord(
        version=2,
        round=0,
        elapsed_s=1.0,
        participants=1,
        global_accuracy=0.5,
        global_loss=nan,
        personal_accuracy=nan,
        train_loss=nan,
        train_accuracy=nan,
        samples=1,
        samples_per_s=1.0,
        bytes_up=0,
        bytes_down=0,
    )


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_the_experiments_stop_reaches_the_run_but_not_back() -> None:
    parent = threading.Event()
    with run_stop(parent, poll_s=0.01) as (child, _):
        child.set()  # the embedded runner sets its own event at the end of a job
    assert not parent.is_set()
    with run_stop(parent, poll_s=0.01) as (child, _):
        parent.set()
        assert child.wait(2.0)


def test_a_stalled_run_is_stopped_and_told() -> None:
    clock, told = FakeClock(), []
    watched = run_stop(
        threading.Event(), 10.0, on_stall=lambda: told.append(clock.now), clock=clock, poll_s=0.001
    )
    with watched as (stop, _):
        clock.now = 9.0
        assert not stop.wait(0.05)  # polled many times, still within stall_s
        clock.now = 10.0
        assert stop.wait(5.0)
    assert told == [10.0]


def test_each_version_resets_the_wait() -> None:
    clock = FakeClock()
    with run_stop(threading.Event(), 10.0, clock=clock, poll_s=0.001) as (stop, beat):
        clock.now = 9.0
        beat.record(record())
        clock.now = 18.0
        assert not stop.wait(0.05)
        assert beat.idle_s() == 9.0
        clock.now = 19.0
        assert stop.wait(5.0)


def test_zero_watches_no_records() -> None:
    clock = FakeClock()
    with run_stop(threading.Event(), 0.0, clock=clock, poll_s=0.001) as (stop, _):
        clock.now = 1e9
        assert not stop.wait(0.05)
