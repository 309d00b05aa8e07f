"""What the aggregator's polls cost in reads of the members, with many members; run by hand.

    python -m benchmarks.aggregator_members [--members 1000,10000] [--seconds 5] [--redis URL]

For each store (the in-memory one, and Redis when `--redis` names one) and each member count
N, N client members are recorded as the coordinator records them, and a real aggregator runs
for `--seconds` in each of the two phases where it polls: *waiting* for members (round 0 needs
one more member than there are) and *collecting* a round (10 members sampled, none answers, the
deadline far off). The broker is the in-memory one (it plays no part in member reads). Every read
of the members (`client_members`: the store's scan plus the parsing) is timed; the figures are
reads per second and the read time per second of polling. Run it at two commits to compare
(`fraction` sizes the cohort, so the script runs at commits from before `clients.per_round`).
"""

from __future__ import annotations

import argparse
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import services.aggregator.gate as gate
from broker.memory_store import InMemoryWeightStore
from broker.store import MemberStore
from broker.topology import reply_queue
from services.aggregator.aggregator import Aggregator, ensure_initial_version
from services.algorithms.registry import build_strategy
from services.common.backends import Backends, Embedded
from services.common.membership import MemberInfo, member_id
from services.config.root import Settings
from services.report.records import ListSink

LOG = logging.getLogger("bench.aggregator_members")


class ReadMeter:
    """Times every read of the members the aggregator makes."""

    def __init__(self, read: Callable[[MemberStore, str], dict[str, MemberInfo]]) -> None:
        self.read, self.count, self.seconds = read, 0, 0.0

    def __call__(self, store: MemberStore, job: str) -> dict[str, MemberInfo]:
        started = time.perf_counter()
        try:
            return self.read(store, job)
        finally:
            self.count += 1
            self.seconds += time.perf_counter() - started


def settings_for(job: str, n: int, redis: str | None, *, waiting: bool) -> Settings:
    clients: dict[str, Any] = {"count": n + 1, "heartbeat_s": 2.0, "start_timeout_s": 1e6}
    clients |= {"min_to_start": n + 1} if waiting else {"fraction": 10 / n}
    sections: dict[str, Any] = {
        "job": {"name": job, "rounds": 1},
        "clients": clients,
        "rounds": {"deadline_s": 1e4},
        "algorithm": {"name": "fedavg"},
    }
    if redis:
        sections["store"] = {"kind": "redis", "redis_url": redis}
    return Settings.model_validate(sections)


def phase(n: int, seconds: float, redis: str | None, *, waiting: bool) -> tuple[float, float]:
    """(reads per second, read milliseconds per second) of one phase."""
    job = f"bench-members-{n}-{'wait' if waiting else 'collect'}-{time.time_ns() % 10**9}"
    settings = settings_for(job, n, redis, waiting=waiting)
    embedded = Embedded(store=InMemoryWeightStore())
    backends = Backends(settings.broker, settings.store, embedded)
    store = backends.open_store()
    try:
        ensure_initial_version(store, settings, build_strategy("fedavg"), LOG)
        for i in range(n):
            info = MemberInfo(f"m{i:05d}", 0, "block1", 10, i, (), 0.0, f"s{i}")
            store.heartbeat(job, member_id(info.client), 600.0, info.to_info())
        broker = backends.open_broker("bench-setup")
        broker.declare([reply_queue(job, f"m{i:05d}") for i in range(n)])
        # Instrumentation: the name gate.py calls is replaced, so every read the book makes is
        # timed (at any commit: the script also measures the code before the change).
        names = vars(gate)
        meter = ReadMeter(names["client_members"])
        names["client_members"] = meter
        stop = threading.Event()
        aggregator = Aggregator(settings, backends, sink=ListSink())
        thread = threading.Thread(target=aggregator.run, args=(stop,), daemon=True)
        thread.start()
        time.sleep(1.0)  # start-up and the round's opening read
        count, spent = meter.count, meter.seconds
        time.sleep(seconds)
        count, spent = meter.count - count, meter.seconds - spent
        stop.set()
        thread.join(30)
        names["client_members"] = meter.read
        broker.close()
        store.delete_job(job)
    finally:
        store.close()
    return count / seconds, 1000 * spent / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--members", default="1000,10000")
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--redis", default=None, help="a Redis URL (else the memory store only)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    stores = [("memory", None)] + ([("redis", args.redis)] if args.redis else [])
    print("| store | members | phase | reads/s | ms per read | read ms per s |")
    print("|---|---|---|---|---|---|")
    for name, url in stores:
        for n in (int(x) for x in args.members.split(",")):
            for waiting in (True, False):
                rate, ms = phase(n, args.seconds, url, waiting=waiting)
                what = "waiting for members" if waiting else "collecting a round"
                each = ms / rate if rate else float("nan")
                row = f"| {name} | {n:,} | {what} | {rate:.1f} | {each:.1f} | {ms:.1f} |"
                print(row, flush=True)


if __name__ == "__main__":
    main()
