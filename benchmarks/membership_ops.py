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
too). The sweep, once per `clients.heartbeat_s`, reads every member: its time is reported
beside (it ran once per heartbeat and per Join before issue 13); the benchmark's heartbeat_s
is an hour so that no sweep falls inside a measurement.

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
    client_members,
    member_id,
)
from services.config.root import Settings
from services.coordinator.coordinator import Coordinator, CoordinatorStats

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
class SizeResult:
    members: int
    join: Cost
    heartbeat: Cost
    host_member: Cost  # per member listed in a HostHeartbeat
    sweep_ms: float  # one read of every member (median of 3)


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

    def sweep_ms(self) -> float:
        times = []
        for _ in range(3):
            started = time.perf_counter()
            found = client_members(self.store, self.job)
            times.append((time.perf_counter() - started) * 1e3)
            assert len(found) >= self.members
        return sorted(times)[1]

    def close(self) -> None:
        self.store.delete_job(self.job)
        self.store.close()
        self.host.close()


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
        return SizeResult(members, join, heartbeat, host_member, bench.sweep_ms())
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
        "costs are per member. The sweep (one read of every member) runs once per "
        "`clients.heartbeat_s`; before issue 13 the coordinator also made it for every "
        "Heartbeat and every Join.",
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
    lines += ["", "| members | sweep (read of every member) ms |", "|---:|---:|"]
    lines += [f"| {r.members:,} | {r.sweep_ms:.1f} |" for r in results]
    largest = results[-1]
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
        f"- The sweep's read of every member took {largest.sweep_ms:.0f} ms at "
        f"{largest.members:,} members: what each Heartbeat and Join cost before, at least.",
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
