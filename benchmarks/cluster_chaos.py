"""Cluster chaos (issue 12 item 5): a sharded SFL job as separate processes over the local
cluster of `scripts/cluster.sh` (three RabbitMQ nodes with quorum queues, Redis with a replica
and three Sentinels) while its nodes are killed; then every batch is accounted for, the stalls
measured, and the accuracy compared with an undisturbed run of the same seed on the same
cluster.

    python -m benchmarks.cluster_chaos --workers 3 --clients 8 --rounds 4 --steps 16 \\
        --seed 0 --json chaos.json

What happens, at points of the job (batches seen by the tap), not of the clock:

1. A third of the way through: SIGKILL the RabbitMQ node that leads `<job>.smashed.0`. Half a
   second later, while the broker fails over (its quorum queues elect new leaders, the
   connections to the dead node move to the others), SIGKILL a worker; a replacement starts.
   The node is started again `--node-down-s` seconds later and rejoins the cluster.
2. Two thirds of the way through: SIGKILL the Redis primary; Sentinel promotes the replica,
   and the old primary is started again, as a replica of the new one.

The accounting is the soak's (`benchmarks.soak`): sent = distinct (client, seq) batches on
the tap queues, applied = the shards' checkpoint audits, so a batch applied twice or never
shows. **Stall**: the longest gap between two batches first seen by the tap, among the gaps
that end in the 30 s after an event (or before the next kill, if that comes sooner: the
worker killed a second into the broker failover has the rest of that failover's stall);
the undisturbed run's longest gap (its round boundaries: evaluation, aggregation) is printed
beside it. The tap is itself a consumer on the cluster:
when its own node dies, its reconnect (a fraction of a second) is counted in the stall.

The CI test `tests/cluster/test_cluster_chaos.py` runs a shorter job; the results of a full
run are in docs/reliability.md, "Cluster chaos".
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import random
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace

from benchmarks.cluster import ClusterError, LocalCluster, wait_for
from benchmarks.common import machine_line
from benchmarks.soak import (
    Children,
    SoakConfig,
    SoakReport,
    Tap,
    WorkerKiller,
    add_job_arguments,
    job_shape,
    run_once,
    table,
)
from broker.store import WeightStore
from broker.topology import shard_queue_name

LOG = logging.getLogger("splitmq.chaos")
_POLL_S = 0.1
STALL_WINDOW_S = 30.0


@dataclass(frozen=True)
class ChaosPlan:
    kill_broker_leader: bool = True
    kill_worker: bool = True  # during the broker failover
    kill_redis_primary: bool = True
    node_down_s: float = 5.0  # the killed RabbitMQ node is started again after this


@dataclass
class ChaosEvent:
    name: str
    at_s: float  # since training began
    detail: str = ""
    recovered_s: float | None = None  # the cluster's own recovery (new leader / primary)
    stall_s: float | None = None  # the job's: see the module docstring


@dataclass
class ChaosReport:
    soak: SoakReport
    events: list[ChaosEvent] = field(default_factory=list)
    longest_stall_s: float | None = None
    calm: SoakReport | None = None
    calm_longest_gap_s: float | None = None
    arrivals: list[float] = field(default_factory=list)  # the tap's, since training began

    @property
    def ok(self) -> bool:
        s = self.soak
        return (
            s.status == "finished"
            and not s.problems
            and s.lost == 0
            and s.duplicates == 0
            and s.checksum_mismatches == 0
            and s.dead_lettered == 0
            and s.left_in_queues == 0
            and s.applied == s.sent
        )


def node_number(node: str) -> int:
    """`splitmq-2@localhost` -> 2."""
    return int(node.split("@", 1)[0].rsplit("-", 1)[1])


class ClusterChaos:
    """The events above, driven by the tap's count of batches (`run` is the chaos thread)."""

    def __init__(
        self,
        cluster: LocalCluster,
        plan: ChaosPlan,
        cfg: SoakConfig,
        children: Children,
        report: SoakReport,
        tap: Tap,
        job: str,
    ) -> None:
        self._cluster = cluster
        self._plan = plan
        self._children = children
        self.tap = tap
        self._job = job
        self._expected = cfg.clients * cfg.steps * cfg.rounds
        self._kill_worker = WorkerKiller(cfg, children, report, random.Random(cfg.seed))
        self.events: list[ChaosEvent] = []
        self.started: float | None = None
        self._restart: threading.Thread | None = None
        self._errors: list[str] = report.problems

    def run(self, stop: threading.Event, started: Callable[[], float | None]) -> None:
        try:
            self._run(stop, started)
        except Exception as exc:  # a failed kill or wait is a finding, not a crash of the run
            LOG.exception("chaos failed")
            self._errors.append(f"chaos: {type(exc).__name__}: {exc}")

    def _run(self, stop: threading.Event, started: Callable[[], float | None]) -> None:
        plan = self._plan
        if plan.kill_broker_leader or plan.kill_worker:
            # Asked before training: rabbitmqctl takes seconds, and the kill must not wait.
            leader = self._leader(stop) if plan.kill_broker_leader else None
            if not self._wait_for(stop, started, self._expected // 3):
                return
            self._broker_failover(leader)
        if plan.kill_redis_primary:
            if not self._wait_for(stop, started, 2 * self._expected // 3):
                return
            self._redis_failover()

    def _wait_for(
        self, stop: threading.Event, started: Callable[[], float | None], batches: int
    ) -> bool:
        while len(self.tap.sent) < batches:
            if stop.wait(_POLL_S):
                LOG.warning("the job ended before %d batches: chaos not done", batches)
                return False
            if self.started is None:
                self.started = started()
        return True

    def _leader(self, stop: threading.Event) -> str | None:
        """The node leading shard 0's queue, once the job has declared it."""
        queue = shard_queue_name(self._job, 0)
        while not stop.is_set():
            try:
                return self._cluster.quorum_leader(queue)
            except ClusterError:
                stop.wait(1.0)  # not declared yet, or the CLI met a node going away
        return None

    def _now(self) -> float:
        return time.monotonic() - (self.started or time.monotonic())

    def _broker_failover(self, leader: str | None) -> None:
        cluster, plan = self._cluster, self._plan
        victim, event = None, None
        queue = shard_queue_name(self._job, 0)
        if leader is not None:
            victim = node_number(leader)
            event = ChaosEvent("RabbitMQ leader SIGKILL", self._now(), f"{leader} led {queue}")
            kill = cluster.kill_rabbit(victim)
            self.events.append(event)
            LOG.warning("SIGKILLed RabbitMQ %s (leader of %s)", leader, queue)
        if plan.kill_worker:
            if event is not None:
                time.sleep(0.5)  # connections are moving to the other nodes
            at = self._now()
            self.events.append(ChaosEvent("worker SIGKILL", at, self._kill_worker() or ""))
        if event is not None and leader is not None and victim is not None:
            change = cluster.wait_for_new_leader(queue, leader, timeout=60.0, since=kill.at)
            event.recovered_s = change.seconds
            event.detail += f"; rabbitmqctl names {change.new} after {change.seconds:.1f} s"
            # Back in the background: a rejoin takes seconds to tens of seconds on a loaded
            # machine, and the Redis kill must still come mid-training.
            wait = max(0.0, plan.node_down_s - (self._now() - event.at_s))
            self._restart = threading.Thread(target=self._rejoin, args=(victim, wait))
            self._restart.start()

    def _rejoin(self, node: int, after_s: float) -> None:
        time.sleep(after_s)
        at = self._now()
        took = self._cluster.start_rabbit(node)
        self.events.append(ChaosEvent("RabbitMQ node back", at, f"rejoined in {took:.1f} s"))

    def join(self) -> None:
        """Until the killed node is back (a run ends with a whole cluster)."""
        if self._restart is not None:
            self._restart.join()

    def _redis_failover(self) -> None:
        cluster = self._cluster
        event = ChaosEvent("Redis primary SIGKILL", self._now())
        old, _ = cluster.kill_redis_primary()
        self.events.append(event)
        LOG.warning("SIGKILLed the Redis primary %s", old)
        change = cluster.wait_for_new_primary(old, timeout=60.0)
        event.recovered_s = self._now() - event.at_s
        event.detail = f"{old} -> {change.new} after {event.recovered_s:.1f} s"
        cluster.restart_redis(int(old.rsplit(":", 1)[1]))


class Watch:
    """No chaos: keeps the tap, for the undisturbed run's gaps."""

    def __init__(self, tap: Tap) -> None:
        self.tap = tap

    def run(self, stop: threading.Event, started: Callable[[], float | None]) -> None:
        while not stop.wait(0.5):
            started()


def gaps(arrivals: list[float]) -> list[tuple[float, float]]:
    """(end, length) of each gap between consecutive first sightings."""
    times = sorted(arrivals)
    return [(b, b - a) for a, b in itertools.pairwise(times)]


def stall_after(arrivals: list[float], at: float, window_s: float = STALL_WINDOW_S) -> float:
    """The longest gap ending in [at, at + window_s] (the gap across `at` included)."""
    return max(
        (length for end, length in gaps(arrivals) if at <= end <= at + window_s), default=0.0
    )


def soak_config(cluster: LocalCluster, args: argparse.Namespace, chaos: bool) -> SoakConfig:
    return SoakConfig(
        **job_shape(args),
        chaos=chaos,
        timeout_s=args.timeout,
        amqp_urls=tuple(cluster.amqp_urls),
        redis_url=cluster.redis_url,
        sentinels=tuple(cluster.sentinels),
        min_replicas=args.min_replicas,
    )


def run_chaos(cluster: LocalCluster, cfg: SoakConfig, plan: ChaosPlan) -> ChaosReport:
    made: list[ClusterChaos] = []

    def make(children: Children, report: SoakReport, tap: Tap, _store: WeightStore) -> ClusterChaos:
        chaos = ClusterChaos(cluster, plan, cfg, children, report, tap, report.job)
        made.append(chaos)
        return chaos

    soak = run_once(cfg, make)
    chaos = made[0]
    chaos.join()
    chaos.events.sort(key=lambda e: e.at_s)
    started = chaos.started or 0.0
    arrivals = [t - started for t in chaos.tap.arrivals]
    kills = [e.at_s for e in chaos.events if e.name.endswith("SIGKILL")]
    for event in chaos.events:
        end = min((at for at in kills if at > event.at_s), default=float("inf"))
        event.stall_s = stall_after(arrivals, event.at_s, min(STALL_WINDOW_S, end - event.at_s))
    stalls = [e.stall_s for e in chaos.events if e.stall_s is not None]
    return ChaosReport(soak, chaos.events, max(stalls, default=None), arrivals=arrivals)


def run_calm(cfg: SoakConfig) -> tuple[SoakReport, float | None]:
    watched: list[Watch] = []

    def make(_c: Children, _r: SoakReport, tap: Tap, _s: WeightStore) -> Watch:
        watched.append(Watch(tap))
        return watched[0]

    calm = run_once(replace(cfg, chaos=False), make)
    arrivals = watched[0].tap.arrivals
    return calm, max((length for _, length in gaps(arrivals)), default=None)


def ensure_whole(cluster: LocalCluster, timeout_s: float = 120.0) -> None:
    """Every node up (a killed one started again), before a run begins."""
    cluster.up()
    wait_for("the whole cluster", lambda: True if cluster.is_up() else None, timeout_s, 1.0)


def chaos_table(report: ChaosReport) -> str:
    lines = [table(report.soak, report.calm), "", "| event | at (s) | detail | stall (s) |"]
    lines.append("|---|---|---|---|")
    for e in report.events:
        stall = "-" if e.stall_s is None else f"{e.stall_s:.1f}"
        lines.append(f"| {e.name} | {e.at_s:.1f} | {e.detail} | {stall} |")
    if report.calm_longest_gap_s is not None:
        lines.append(f"| (undisturbed run: longest gap) | | | {report.calm_longest_gap_s:.1f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_job_arguments(
        parser, SoakConfig(workers=3, clients=8, shards=3, rounds=4, steps=16, seed=0)
    )
    parser.add_argument("--min-replicas", type=int, default=1, help="store.min_replicas")
    parser.add_argument("--node-down-s", type=float, default=5.0)
    parser.add_argument("--timeout", type=float, default=900.0)
    parser.add_argument("--no-calm", action="store_true", help="skip the undisturbed run")
    parser.add_argument("--keep-cluster", action="store_true", help="leave it up afterwards")
    parser.add_argument("--json", help="write the reports here")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("pika").setLevel(logging.WARNING)
    signal.signal(signal.SIGTERM, signal.default_int_handler)

    cluster = LocalCluster()
    was_up = cluster.is_up()
    ensure_whole(cluster)
    try:
        cfg = soak_config(cluster, args, chaos=True)
        report = run_chaos(cluster, cfg, ChaosPlan(node_down_s=args.node_down_s))
        if not args.no_calm:
            ensure_whole(cluster)
            report.calm, report.calm_longest_gap_s = run_calm(cfg)
    finally:
        if not (was_up or args.keep_cluster):
            cluster.down()
    print(machine_line())
    print(chaos_table(report))
    if args.json:
        with open(args.json, "w") as out:
            json.dump(asdict(report), out, indent=2)
    return 0 if report.ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
