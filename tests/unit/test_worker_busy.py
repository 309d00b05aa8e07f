"""A worker's busy fraction (workers/worker.py) and the heartbeat the autoscaler reads it from."""

from __future__ import annotations

import os
import socket
import threading
import time

from services.common.backends import Backends, Embedded
from services.common.leases import worker_beat
from tests.unit.test_worker_support import make_settings, one_torch_thread, seed_version
from workers.worker import BusyMeter, Worker

__all__ = ["one_torch_thread"]


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_busy_is_the_share_of_the_window_not_spent_waiting() -> None:
    clock = Clock()
    meter = BusyMeter(clock)
    assert meter.take() is None  # no time has passed
    clock.now += 10.0
    meter.waited(3.0)
    assert meter.take() == 0.7
    # A new window: all of it waiting.
    clock.now += 4.0
    meter.waited(4.0)
    assert meter.take() == 0.0


def test_a_wait_that_began_before_the_window_counts_only_its_part_inside() -> None:
    clock = Clock()
    meter = BusyMeter(clock)
    clock.now += 10.0
    meter.waited(9.9)
    assert meter.take() is not None
    # 0.2 s polls, 1 % busy: the poll that spanned the take began 0.15 s before it.
    clock.now += 0.05
    meter.waited(0.2)
    for _ in range(9):
        clock.now += 0.2
        meter.waited(0.198)
    fraction = meter.take()
    assert fraction is not None and 0.0 < fraction < 0.02


def test_a_short_window_repeats_the_last_fraction_and_keeps_counting() -> None:
    clock = Clock()
    meter = BusyMeter(clock)
    clock.now += 0.5
    assert meter.take(min_window_s=1.0) is None  # a worker that just started says nothing
    clock.now += 1.5
    meter.waited(0.5)
    assert meter.take(min_window_s=1.0) == 0.75  # 0.5 of 2.0 waited
    clock.now += 0.1
    assert meter.take(min_window_s=1.0) == 0.75
    clock.now += 1.0
    meter.waited(-1.0)  # a clock step backwards is no waiting
    assert meter.take(min_window_s=1.0) == 1.0


def test_an_idle_worker_heartbeats_its_host_pid_shards_and_a_low_busy_fraction(job: str) -> None:
    settings = make_settings(job, workers={"lease_ttl_s": 0.6})
    embedded = Embedded()
    seed_version(embedded.store, settings)
    backends = Backends(settings.broker, settings.store, embedded)
    stop = threading.Event()
    thread = threading.Thread(target=Worker(settings, backends, worker_id="w").run, args=(stop,))
    thread.start()
    try:
        # The window of the first heartbeats that report shard 0 holds the replica's load (busy
        # work, as it should be): judge a window that starts after it, two heartbeats later
        # (each heartbeat renews the member's expiry).
        deadline = time.monotonic() + 30
        beats: list[float] = []
        while True:
            member = embedded.store.live_members(job).get("worker:w")
            if member is not None and "busy" in member.info and member.info["shards"] == "0":
                if not beats or member.expires_at != beats[-1]:
                    beats.append(member.expires_at)
                if len(beats) >= 3:
                    break
            assert time.monotonic() < deadline, "no busy fraction in the heartbeat"
            time.sleep(0.02)
    finally:
        stop.set()
        thread.join(30)
    assert member.info["host"] == socket.gethostname()
    assert member.info["pid"] == str(os.getpid())
    report = worker_beat(member)
    assert report is not None and report.shards == (0,)
    # Nothing to serve: it spends its time waiting for deliveries.
    assert report.busy is not None and report.busy < 0.5
