"""What one membership event costs the coordinator and Redis, at 100, 1,000 and 10,000 members
(issue 13: O(1) per event, not a read of every member); run by hand.

    python -m benchmarks.membership_ops [--members 100,1000,10000] [--quick]
                                        [--redis-url URL] [--json PATH] [--write-docs]

For each size N it records N members in a fresh job on a private `redis-server` (appendfsync
everysec; `--redis-url` uses another, whose INFO must not be shared with other work), then runs
the real `Coordinator` over the in-memory broker and that Redis store, and sends it, as one
client host `bench` would:

- Joins of new clients through the host (each bound to the host's queue and welcomed with
  cnn5's client weights),
- Heartbeats of random members,
- HostHeartbeats listing all N members, 1,024 a message, over and over.

Per event it reports the wall time (sent back to back, so the coordinator's handling paces
it), the benchmark process's CPU time (the coordinator thread and the sender), and the Redis
commands (INFO commandstats deltas: scripts, and all commands counted, those inside scripts
too); the benchmark's heartbeat_s is an hour so that no sweep falls inside a measurement.

The sweep is measured beside, on the coordinator's `Roster` over the same store: the members
are renewed as HostHeartbeats do, except 1% of them (at least one), which expire in Redis;
the sweep then asks about those only (`member_ttls`) and announces them. Its wall time and
Redis commands are reported beside the full read of every member (`Roster.sync`: what the
sweep was before, now every `SYNC_SWEEPS`-th sweep, at the start and before a full-job
refusal).

`--quick` runs 100 and 1,000 members with fewer events (a test runs it); `--write-docs`
rewrites the "membership-ops" section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import redis

from benchmarks.common import command_line, machine_line, write_section
from benchmarks.redis_fsync import start_redis
from broker.codec import encode
from broker.memory_broker import InMemoryBroker
from broker.messages import Heartbeat, HostHeartbeat, Join, Message, new_message_id
from broker.redis_store import RedisWeightStore
from broker.topology import CONTROL_EXCHANGE, host_queue, host_queue_name
from services.aggregator.aggregator import ensure_initial_version
from services.algorithms.registry import build_strategy
from services.common.backends import Backends, Embedded
from services.common.membership import (
    HOST_HEARTBEAT_MEMBERS,
    HOST_INFO_KEY,
    MemberInfo,
    member_id,
)
from services.config.root import Settings
from services.coordinator.coordinator import Coordinator, CoordinatorStats
from services.coordinator.roster import SYNC_SWEEPS, Roster

HOST = "bench"
SIZES = (100, 1_000, 10_000)
QUICK_SIZES = (100, 1_000)


@dataclass(frozen=True)
class Counts:
    joins: int = 200
    heartbeats: int = 3_000
    host_members: int = 30_000  # member renewals through HostHeartbeats


QUICK = Counts(joins=20, heartbeats=200, host_members=2_000)


@dataclass(frozen=True)
class Cost:
    """One kind of event at one size: per event."""

    events: int
    wall_us: float
    cpu_us: float
    scripts: float  # EVALSHA / EVAL calls
    commands: float  # every command Redis counted, those run by scripts too
    breakdown: dict[str, float]  # command -> calls per event


@dataclass(frozen=True)
class Sweep:
    """The coordinator's sweep at one size, and the full read it replaced."""

    members: int  # in the job then (the benchmark's Joins added)
    expired: int  # members that expired before the sweep (1%, at least one)
    announced: int  # of them announced by it
    sweep_ms: float  # wall
    sweep_commands: float  # every command Redis counted
    sync_ms: float  # one read of every member (median of 3)
    sync_commands: float


@dataclass(frozen=True)
class SizeResult:
    members: int
    join: Cost
    heartbeat: Cost
    host_member: Cost  # per member listed in a HostHeartbeat
    sweep: Sweep


def command_calls(raw: redis.Redis) -> dict[str, int]:
    stats: dict[str, Any] = raw.info("commandstats")
    return {name.removeprefix("cmdstat_"): int(v["calls"]) for name, v in stats.items()}


def settings_for(job: str, redis_url: str, count: int) -> Settings:
    return Settings.model_validate(
        {
            "broker": {"kind": "memory"},
            "store": {"kind": "redis", "redis_url": redis_url},
            "job": {"name": job, "rounds": 1000, "seed": 1},
            "clients": {
                "count": count,
                "min_to_start": 1,
                "heartbeat_s": 3600.0,
                "heartbeat_ttl_s": 7200.0,
            },
        }
    )


def client_id(i: int) -> str:
    return f"{HOST}-{i}"


class Bench:
    """One job of N members with its coordinator serving, and the host's handle."""

    def __init__(self, redis_url: str, raw: redis.Redis, members: int, counts: Counts) -> None:
        self.job = f"bench-members-{members}-{new_message_id()[:8]}"
        self.raw = raw
        self.members = members
        self.settings = settings_for(self.job, redis_url, members + counts.joins)
        self.store = RedisWeightStore(redis_url)
        self.embedded = Embedded()
        backends = Backends(self.settings.broker, self.settings.store, self.embedded)
        self.coordinator = Coordinator(self.settings, backends, poll_s=0.01)
        self.host = InMemoryBroker(self.embedded.hub)
        self.host.declare([host_queue(self.job, HOST)])
        self.host.subscribe(host_queue_name(self.job, HOST), prefetch=100_000)
        self._joined = members  # the next new client's index

    def populate(self) -> None:
        ttl = self.settings.clients.heartbeat_ttl_s
        for i in range(self.members):
            info = MemberInfo(client_id(i), 0, "block1", 100, i, (), time.time(), f"s{i}")
            self.store.heartbeat(self.job, member_id(info.client), ttl, info.to_info())
        strategy = build_strategy(self.settings.algorithm.name)
        ensure_initial_version(self.store, self.settings, strategy, logging.getLogger("bench"))

    def send(self, message: Message) -> None:
        self.host.publish(CONTROL_EXCHANGE, self.job, encode(message))

    def drain(self) -> None:
        while (delivery := self.host.get(0.0)) is not None:
            self.host.ack(delivery)

    def measure(
        self, events: int, send_all: Callable[[], None], done: Callable[[CoordinatorStats], int]
    ) -> Cost:
        """Send with `send_all`, wait until `done(stats)` reaches `events` more than before."""
        stats = self.coordinator.stats
        target = done(stats) + events
        before_calls = command_calls(self.raw)
        cpu, wall = time.process_time(), time.perf_counter()
        send_all()
        deadline = time.monotonic() + 600
        while done(stats) < target:
            if time.monotonic() > deadline:
                raise RuntimeError(f"the coordinator handled too few events: {stats}")
            time.sleep(0.0005)
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        after_calls = command_calls(self.raw)
        delta = {k: v - before_calls.get(k, 0) for k, v in after_calls.items()}
        delta = {k: v for k, v in delta.items() if v > 0 and k != "info"}
        scripts = delta.get("evalsha", 0) + delta.get("eval", 0)
        return Cost(
            events,
            wall / events * 1e6,
            cpu / events * 1e6,
            scripts / events,
            sum(delta.values()) / events,
            {k: round(v / events, 3) for k, v in sorted(delta.items())},
        )

    def joins(self, count: int) -> Cost:
        first = self._joined
        self._joined += count

        def send_all() -> None:
            for i in range(first, first + count):
                info = {HOST_INFO_KEY: HOST, "index": str(i)}
                self.send(Join(self.job, client_id(i), new_message_id(), 0, 100, 0, info))

        cost = self.measure(count, send_all, lambda s: s.joined)
        self.drain()
        return cost

    def heartbeats(self, count: int, rng: random.Random) -> Cost:
        def send_all() -> None:
            for _ in range(count):
                client = client_id(rng.randrange(self.members))
                self.send(Heartbeat(self.job, client, new_message_id(), 1))

        return self.measure(count, send_all, lambda s: s.heartbeats)

    def host_heartbeats(self, renewals: int) -> Cost:
        chunks = [
            {
                client_id(i): 1
                for i in range(start, min(start + HOST_HEARTBEAT_MEMBERS, self.members))
            }
            for start in range(0, self.members, HOST_HEARTBEAT_MEMBERS)
        ]
        rounds = max(1, -(-renewals // self.members))

        def send_all() -> None:
            for _ in range(rounds):
                for chunk in chunks:
                    self.send(HostHeartbeat(self.job, HOST, new_message_id(), 1, chunk))

        return self.measure(rounds * self.members, send_all, lambda s: s.host_members)

    def sweep(self) -> Sweep:
        """The sweep after 1% of the members expired (the rest renewed), and the full read."""
        clock = _Clock()
        announced: list[str] = []
        ttl = self.settings.clients.heartbeat_ttl_s
        count = self.settings.clients.count
        roster = Roster(
            self.store, self.job, count=count, ttl_s=ttl, expired=announced.extend, clock=clock
        )
        sync_ms, sync_commands = [], []
        for _ in range(3):
            ms, commands = self._timed(roster.sync)
            sync_ms.append(ms)
            sync_commands.append(commands)
        clients = sorted(roster.index.clients())
        expiring = clients[::100]  # 1%, at least one
        for client in expiring:  # 1 s left in Redis, and no renewal
            self.store.heartbeat(self.job, member_id(client), 1.0)
        clock.now += ttl / 2
        renewed = sorted(set(clients) - set(expiring))
        for start in range(0, len(renewed), HOST_HEARTBEAT_MEMBERS):
            roster.renew(renewed[start : start + HOST_HEARTBEAT_MEMBERS])
        time.sleep(1.1)
        clock.now += ttl / 2 + 1.0  # past the deadlines of the ones not renewed
        ms, commands = self._timed(roster.sweep)
        return Sweep(
            len(clients),
            len(expiring),
            len(announced),
            ms,
            commands,
            sorted(sync_ms)[1],
            sorted(sync_commands)[1],
        )

    def _timed(self, action: Callable[[], object]) -> tuple[float, float]:
        """Wall ms of `action` and the Redis commands it made."""
        before = command_calls(self.raw)
        started = time.perf_counter()
        action()
        ms = (time.perf_counter() - started) * 1e3
        after = command_calls(self.raw)
        commands = sum(v - before.get(k, 0) for k, v in after.items() if k != "info")
        return ms, float(commands)

    def close(self) -> None:
        self.store.delete_job(self.job)
        self.store.close()
        self.host.close()


class _Clock:
    """The roster's clock, moved by hand: its deadlines pass without waiting for them."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@contextmanager
def serving(coordinator: Coordinator) -> Iterator[None]:
    stop = threading.Event()
    errors: list[BaseException] = []

    def run() -> None:
        try:
            coordinator.run(stop)
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=run, name="coordinator", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(30)
    if errors:
        raise errors[0]


def run_size(redis_url: str, raw: redis.Redis, members: int, counts: Counts) -> SizeResult:
    bench = Bench(redis_url, raw, members, counts)
    try:
        bench.populate()
        rng = random.Random(members)
        with serving(bench.coordinator):
            # One of each first: the Welcome's weights get cached, the scripts loaded.
            bench.joins(1)
            join = bench.joins(counts.joins - 1)
            bench.heartbeats(1, rng)
            heartbeat = bench.heartbeats(counts.heartbeats, rng)
            bench.host_heartbeats(1)
            host_member = bench.host_heartbeats(counts.host_members)
        assert bench.coordinator.stats.dead_lettered == 0, bench.coordinator.stats
        return SizeResult(members, join, heartbeat, host_member, bench.sweep())
    finally:
        bench.close()


def run(redis_url: str, sizes: tuple[int, ...], counts: Counts) -> list[SizeResult]:
    raw = redis.Redis.from_url(redis_url)
    try:
        return [run_size(redis_url, raw, n, counts) for n in sizes]
    finally:
        raw.close()


def markdown(results: list[SizeResult], machine: str, command: str) -> str:
    lines = [
        "## Membership cost per event (issue 13)",
        "",
        f"`{command}` on {machine}. The real coordinator over the in-memory broker and a "
        "private Redis (appendfsync everysec), one event after another; per event: wall "
        "time, the benchmark process's CPU (coordinator and sender), Redis scripts and all "
        "Redis commands (INFO commandstats, those inside scripts counted too). A HostHeartbeat "
        f"lists {HOST_HEARTBEAT_MEMBERS:,} members (all of them when there are fewer); its "
        "costs are per member. The sweep, once per `clients.heartbeat_s`, asks the store about "
        "the members past their deadline only (here 1% of them, expired in Redis, the rest "
        "renewed); the full read of every member it replaced now runs every "
        f"{SYNC_SWEEPS}th sweep, at the start and before a Join is refused as the job is full.",
        "",
        "| members | event | wall µs | CPU µs | scripts | Redis commands |",
        "|---:|---|---:|---:|---:|---:|",
    ]
    for r in results:
        for name, cost in (
            ("Join", r.join),
            ("Heartbeat", r.heartbeat),
            ("HostHeartbeat member", r.host_member),
        ):
            lines.append(
                f"| {r.members:,} | {name} | {cost.wall_us:,.0f} | {cost.cpu_us:,.0f} | "
                f"{cost.scripts:.3g} | {cost.commands:.3g} |"
            )
    lines += [
        "",
        "| members (with the Joins) | expired | sweep ms | sweep: Redis commands | full read ms | "
        "full read: Redis commands |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    lines += [
        f"| {r.sweep.members:,} | {r.sweep.expired:,} | {r.sweep.sweep_ms:.1f} | "
        f"{r.sweep.sweep_commands:,.0f} | {r.sweep.sync_ms:.1f} | {r.sweep.sync_commands:,.0f} |"
        for r in results
    ]
    largest = results[-1]
    sweep = largest.sweep
    lines += [
        "",
        "- Per event the work does not grow with the members: the same Redis commands at every "
        "size (a Heartbeat: one script renewing one member; a Join: two scripts, the member "
        "read and written, plus the version and the job's status read before and after), and "
        "the same time within noise.",
        "- A Join makes six store round trips (each about a Heartbeat's), which is most of its "
        "time; its Welcome (cnn5's client weights, 9 KiB) is encoded once per Join. A "
        "HostHeartbeat renews all its members in one script: per member "
        f"{largest.heartbeat.wall_us / largest.host_member.wall_us:.0f}x less time than a "
        f"Heartbeat each at {largest.members:,} members.",
        f"- The sweep grows with the members that expired, not with the live ones: at "
        f"{sweep.members:,} members it took {sweep.sweep_ms:.1f} ms for {sweep.expired:,} "
        f"expired (all announced: {sweep.announced:,}), against {sweep.sync_ms:.0f} ms for "
        f"the full read it was before ({sweep.sync_commands / sweep.sweep_commands:.0f}x the "
        "Redis commands).",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--members", default=",".join(str(n) for n in SIZES))
    parser.add_argument("--quick", action="store_true", help="100 and 1,000 members, few events")
    parser.add_argument("--redis-url", help="an existing Redis (default: a private server)")
    parser.add_argument("--json", type=Path, help="write the results here too")
    parser.add_argument("--write-docs", action="store_true")
    args = parser.parse_args(argv)
    sizes = QUICK_SIZES if args.quick else tuple(int(n) for n in args.members.split(","))
    counts = QUICK if args.quick else Counts()
    with tempfile.TemporaryDirectory(prefix="membership-ops-") as tmp:
        process = None
        url = args.redis_url
        if url is None:
            process, port = start_redis("everysec", Path(tmp))
            url = f"redis://127.0.0.1:{port}/0"
        try:
            results = run(url, sizes, counts)
        finally:
            if process is not None:
                process.kill()
                process.wait()
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    machine = machine_line(f"load average {load} at the end")
    text = markdown(results, machine, command_line("benchmarks.membership_ops"))
    print(text)
    if args.json is not None:
        args.json.write_text(json.dumps([asdict(r) for r in results], indent=2) + "\n")
    if args.write_docs:
        write_section("membership-ops", text)


if __name__ == "__main__":
    main()
