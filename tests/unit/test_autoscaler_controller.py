"""The autoscaler's loop: observe, decide, act on a fake pool, with a fake clock."""

from __future__ import annotations

import logging
import os
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from click.testing import CliRunner

from broker.memory_broker import InMemoryBroker
from broker.store import Member
from broker.topology import SMASHED_EXCHANGE, shard_routing_key
from services.autoscaler.controller import Autoscaler, Observer, Snapshot
from services.autoscaler.docker_pool import DockerUnavailableError
from services.autoscaler.pool import Exited, PoolWorker
from services.cli.main import cli
from services.common.backends import Backends, Embedded
from services.common.health import assess, health_member
from services.common.leases import WorkerBeat, worker_beat
from tests.unit.test_worker_support import make_settings


@dataclass
class FakePool:
    workers_: list[PoolWorker] = field(default_factory=list)
    exited: list[Exited] = field(default_factory=list)
    started: int = 0
    closed: bool = False

    def workers(self) -> list[PoolWorker]:
        return list(self.workers_)

    def start_worker(self) -> PoolWorker:
        worker = PoolWorker(f"w{self.started}", f"w{self.started}")
        self.started += 1
        self.workers_.append(worker)
        return worker

    def stop_worker(self, name: str) -> None:
        self.workers_ = [
            PoolWorker(w.name, w.key, stopping=True) if w.name == name else w for w in self.workers_
        ]

    def exit(self, name: str, code: int = 0) -> None:
        self.workers_ = [w for w in self.workers_ if w.name != name]
        self.exited.append(Exited(name, code))

    def reap(self) -> list[Exited]:
        gone, self.exited = self.exited, []
        return gone

    def close(self) -> None:
        self.closed = True


@dataclass
class FakeObserver:
    snapshot_: Snapshot = field(default_factory=lambda: Snapshot({0: 0}, {}))

    def snapshot(self) -> Snapshot:
        return self.snapshot_

    def set(self, depth: int = 0, **workers: tuple[tuple[int, ...], float | None]) -> None:
        reports = {i: WorkerBeat(i, shards, busy) for i, (shards, busy) in workers.items()}
        self.snapshot_ = Snapshot({0: depth}, reports)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def scaler(job: str, pool: FakePool, clock: Clock, **autoscaler: object) -> Autoscaler:
    fields = {
        "min_workers": 1,
        "max_workers": 3,
        "target_depth_per_worker": 10,
        "scale_up_busy": 0.8,
        "scale_down_busy": 0.2,
        "cooldown_s": 5.0,
        "scale_down_after_s": 10.0,
        **autoscaler,
    }
    settings = make_settings(job, algorithm={"name": "sfl", "shards": 3}, autoscaler=fields)
    backends = Backends(settings.broker, settings.store, Embedded())
    return Autoscaler(settings, backends, pool, clock=clock, start_grace_s=60.0)


def test_starts_the_minimum_then_waits_for_its_heartbeat_before_growing(job: str) -> None:
    pool, clock, seen = FakePool(), Clock(), FakeObserver()
    auto = scaler(job, pool, clock)
    auto.step(seen)
    assert [w.name for w in pool.workers()] == ["w0"]
    seen.set(depth=100)  # a backlog, but w0 is not up yet: its effect is still to come
    clock.now = 10
    assert auto.step(seen).reason.startswith("waiting for 1 to start")
    seen.set(depth=100, w0=((0, 1, 2), 1.0))
    decision = auto.step(seen)
    assert decision.target == 3 and pool.started == 3
    assert [(e.action, e.worker, e.running) for e in auto.events] == [
        ("start", "w0", 1),
        ("start", "w1", 2),
        ("start", "w2", 3),
    ]
    assert auto.running == 3


def test_a_hold_is_logged_once_while_only_its_figures_change(
    job: str, caplog: pytest.LogCaptureFixture
) -> None:
    pool, clock, seen = FakePool(), Clock(), FakeObserver()
    auto = scaler(job, pool, clock, max_workers=1)
    auto.step(seen)
    caplog.set_level(logging.INFO, logger="splitmq.autoscaler")
    for busy in (0.91, 0.95, 0.97):  # at the maximum, for another reason each time
        clock.now += 10
        seen.set(w0=((0, 1, 2), busy))
        assert auto.step(seen).reason.startswith("at the maximum of 1 (workers ")
    clock.now += 10
    seen.set(w0=((0, 1, 2), 0.5))
    assert auto.step(seen).reason == "within the band"
    holds = [r.getMessage() for r in caplog.records if "workers, " in r.getMessage()]
    assert holds == [
        "autoscaler: 1 workers, at the maximum of 1 (workers 91% busy)",
        "autoscaler: 1 workers, within the band",
    ]


def test_a_worker_that_never_heartbeats_stops_counting_as_starting(job: str) -> None:
    pool, clock, seen = FakePool(), Clock(), FakeObserver()
    auto = scaler(job, pool, clock)
    auto.step(seen)
    seen.set(depth=100)
    clock.now = 61  # past start_grace_s: e.g. a FedAvg worker, with nothing to heartbeat for
    assert auto.step(seen).target == 3


def test_scales_down_the_idle_shardless_worker_and_waits_for_it_to_exit(job: str) -> None:
    pool, clock, seen = FakePool(), Clock(), FakeObserver()
    auto = scaler(job, pool, clock, min_workers=3)
    auto.step(seen)
    auto.limits = auto.limits.model_copy(update={"min_workers": 1})
    # w1 holds no shard: it goes first although w2 is less busy and newer.
    seen.set(w0=((0,), 0.1), w1=((), 0.15), w2=((1, 2), 0.0))
    clock.now = 10
    assert auto.step(seen).reason == "idle, not for long enough"
    clock.now = 20
    assert auto.step(seen).target == 2
    assert [(w.name, w.stopping) for w in pool.workers()] == [
        ("w0", False),
        ("w1", True),
        ("w2", False),
    ]
    # While w1 hands over, nothing else is decided, however long it takes.
    clock.now = 100
    held = auto.step(seen)
    assert held.target == 2 and held.reason.startswith("waiting for 0 to start, 1 to stop")
    pool.exit("w1", 0)
    seen.set(w0=((0,), 0.1), w2=((1, 2), 0.0))
    auto.step(seen)  # reaped; the idle clock starts again
    clock.now = 111
    assert auto.step(seen).target == 1
    assert [w.name for w in pool.workers() if w.stopping] == ["w2"]  # the least busy
    assert [(e.action, e.worker) for e in auto.events][-3:] == [
        ("stop", "w1"),
        ("exited", "w1"),
        ("stop", "w2"),
    ]


def test_run_observes_the_real_queues_and_closes_the_pool(job: str) -> None:
    pool, stop = FakePool(), threading.Event()
    auto = scaler(job, pool, Clock(), poll_s=0.01)
    thread = threading.Thread(target=auto.run, args=(stop,))
    thread.start()
    try:
        for _ in range(500):
            if pool.started:
                break
            stop.wait(0.01)
    finally:
        stop.set()
        thread.join(10)
    assert not thread.is_alive()
    assert pool.started == 1 and pool.closed


def test_observer_reads_ready_depth_per_shard_and_the_workers_heartbeats(job: str) -> None:
    embedded = Embedded()
    broker = InMemoryBroker(embedded.hub)
    store = embedded.store
    observer = Observer(broker, store, make_settings(job, algorithm={"name": "sfl", "shards": 2}))
    assert observer.snapshot().depths == {0: 0, 1: 0}  # declared the queues itself
    for _ in range(3):
        broker.publish(SMASHED_EXCHANGE, shard_routing_key(job, 1), b"x")
    store.heartbeat(job, "worker:a", 30, {"shards": "0,1", "busy": "0.500"})
    store.heartbeat(job, "worker:b", 30, {"shards": "", "busy": "0.1"})
    store.heartbeat(job, "worker:c", 30, {"shards": ""})  # just started: no busy yet
    store.heartbeat(job, "client:x", 30, {"shard": "1"})
    store.heartbeat(job, "health:worker:a", 30, {"host": "h"})
    snapshot = observer.snapshot()
    assert snapshot.depths == {0: 0, 1: 3} and snapshot.depth == 3
    assert sorted(snapshot.workers) == ["a", "b", "c"]
    assert snapshot.workers["a"] == WorkerBeat("a", (0, 1), 0.5)
    assert snapshot.busy == 0.3
    # Reading does not consume: the messages are still there for the workers.
    assert observer.snapshot().depths == {0: 0, 1: 3}


def test_unreadable_heartbeat_fields_read_as_absent() -> None:
    report = worker_beat(Member("worker:z", 0.0, {"shards": "1,x", "busy": "lots"}))
    assert report == WorkerBeat("z", (), None)
    assert worker_beat(Member("worker:z", 0.0, {"busy": "7"})) == WorkerBeat("z", (), 1.0)
    assert worker_beat(Member("client:z", 0.0, {})) is None


def test_autoscale_command_needs_the_real_services(tmp_path: Path) -> None:
    config = tmp_path / "job.toml"
    config.write_text('[job]\nname = "clitest"\n[autoscaler]\nmax_workers = 2\n')
    env: dict[str, str | None] = {"SPLITMQ_CONFIG": None, "SPLITMQ_BROKER": None}
    env |= {"SPLITMQ_STORE": None, "SPLITMQ_AMQP_URL": None, "SPLITMQ_REDIS_URL": None}
    runner = CliRunner()
    helped = runner.invoke(cli, ["autoscale", "--help"], env=env)
    assert helped.exit_code == 0
    assert "[CONFIG]" in helped.output and "--log-dir" in helped.output
    result = runner.invoke(cli, ["autoscale", str(config)], env=env)
    assert result.exit_code == 1
    assert "it needs RabbitMQ and Redis" in result.output
    bad = tmp_path / "bad.toml"
    bad.write_text("[autoscaler]\nmin_workers = 3\nmax_workers = 2\n")
    result = runner.invoke(cli, ["autoscale", str(bad)], env=env)
    assert result.exit_code == 1 and "min_workers (3) exceeds max_workers (2)" in result.output


# --- health key (`splitmq check autoscaler`) -------------------------------------------------


class DeadDockerPool(FakePool):
    def start_worker(self) -> PoolWorker:
        self.started += 1
        raise DockerUnavailableError("no daemon at unix:///var/run/docker.sock")


def run_until(auto: Autoscaler, done: Callable[[], bool]) -> None:
    stop = threading.Event()
    thread = threading.Thread(target=auto.run, args=(stop,))
    thread.start()
    try:
        for _ in range(1000):
            if done():
                break
            stop.wait(0.01)
        assert done()
    finally:
        stop.set()
        thread.join(10)
    assert not thread.is_alive()


def test_each_completed_poll_refreshes_the_health_key_and_stopping_removes_it(job: str) -> None:
    settings = make_settings(job, autoscaler={"max_workers": 2, "poll_s": 0.01})
    embedded = Embedded()
    backends = Backends(settings.broker, settings.store, embedded)
    auto = Autoscaler(settings, backends, FakePool(), instance="auto-h-1", clock=Clock())
    key = health_member("autoscaler", "auto-h-1")
    seen: list[Member] = []

    def healthy() -> bool:
        member = embedded.store.live_members(job).get(key)
        if member is not None:
            seen.append(member)
        return member is not None

    run_until(auto, healthy)
    verdict = assess({key: seen[-1]}, "autoscaler", job=job, host=socket.gethostname())
    assert verdict.ok, verdict.reason
    assert seen[-1].info["pid"] == str(os.getpid())
    assert key not in embedded.store.live_members(job)  # stopped: no longer alive


def test_a_poll_that_cannot_act_leaves_the_health_key_to_expire(job: str) -> None:
    settings = make_settings(job, autoscaler={"min_workers": 1, "poll_s": 0.01})
    embedded = Embedded()
    pool = DeadDockerPool()
    backends = Backends(settings.broker, settings.store, embedded)
    auto = Autoscaler(settings, backends, pool, instance="a", clock=Clock())
    keys: list[str] = []

    def three_polls() -> bool:
        keys.extend(embedded.store.live_members(job))
        return pool.started >= 3

    run_until(auto, three_polls)
    assert keys == []  # three polls failed to start a worker: none refreshed the key
