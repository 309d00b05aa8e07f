"""The longest gap between a client's heartbeats, as the coordinator handles them, in a `splitmq
run`-style embedded job (every role a thread of one process) of FedAvg on Fashion-MNIST.

The gap is what a member's `clients.heartbeat_ttl_s` must cover. The script imports `services`
from `sys.path`, so the same file measures another tree too (docs/reliability.md, "Liveness"):

    PYTHONPATH=/tmp/old python benchmarks/heartbeat_gap.py --clients 8

Prints one line: the run's status, and over clients the median and the largest of each client's
longest gap, with the coordinator's heartbeat, expiry and rejoin counts and the load average.
"""

from __future__ import annotations

import argparse
import os
import statistics
import threading
import time
from collections import defaultdict
from itertools import pairwise
from typing import Any

import torch

from services.config.root import Settings
from services.coordinator.coordinator import Coordinator
from services.report.records import ListSink
from services.runtime.embedded import run_embedded


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--data-dir", default=os.environ.get("SPLITMQ_DATA_DIR", ""))
    args = parser.parse_args()
    torch.set_num_threads(1)
    beats: defaultdict[str, list[float]] = defaultdict(list)
    coordinators: list[Coordinator] = []
    handle, setup = Coordinator._heartbeat, Coordinator.__init__

    def timed(self: Coordinator, store: Any, outbox: Any, message: Any) -> str | None:
        beats[message.client].append(time.monotonic())
        return handle(self, store, outbox, message)

    def kept(self: Coordinator, *a: Any, **k: Any) -> None:
        setup(self, *a, **k)
        coordinators.append(self)

    # Instrumented in place: the same file measures trees that predate any hook for it.
    Coordinator._heartbeat = timed  # type: ignore[method-assign]
    Coordinator.__init__ = kept  # type: ignore[method-assign]
    data = {"dataset": "fashion_mnist", "dir": args.data_dir, "eval_samples": 500}
    settings = Settings.model_validate(
        {
            "job": {"name": "heartbeat-gap", "rounds": args.rounds, "seed": 1},
            "data": data,
            "algorithm": {"name": "fedavg", "batch_size": args.batch_size, "local_epochs": 1},
            "clients": {"count": args.clients, "min_to_start": args.clients},
        }
    )
    load_before = os.getloadavg()[0]
    started = time.monotonic()
    outcome = run_embedded(settings, sink=ListSink(), stop=threading.Event())
    gaps = sorted(max(b - a for a, b in pairwise(t)) for t in beats.values() if len(t) > 1)
    stats = coordinators[0].stats
    print(
        f"{outcome.status} in {time.monotonic() - started:.0f} s, {args.clients} clients, "
        f"heartbeat_s {settings.clients.heartbeat_s:g} s, "
        f"ttl {settings.clients.heartbeat_ttl_s:g} s: "
        f"longest gap per client median {statistics.median(gaps):.1f} s, max {gaps[-1]:.1f} s; "
        f"{stats.heartbeats} heartbeats, {stats.expired} expired, {stats.rejoined} rejoined; "
        f"load {load_before:.1f} before, {os.getloadavg()[0]:.1f} after"
    )


if __name__ == "__main__":
    main()
