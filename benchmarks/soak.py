"""Soak run (design §7, issue 5 item 7): a sharded SFL job as separate processes over the real
RabbitMQ and Redis while workers are SIGKILLed, clients leave and rejoin and (optionally) the
broker restarts; then every batch is accounted for, and the accuracy compared with an
undisturbed run of the same seed.

    python -m benchmarks.soak --workers 3 --clients 20 --rounds 8 --steps 20 --seed 0 \
        --kill-every 20 --churn 0.3 --broker-restart --json soak.json

The chaos above is timed (kills every ~20 s, leaves spread over a window): how much of it a
run sees depends on how long the job lasts. `--by-events` instead kills one worker and makes
one client leave and rejoin at points of the job (benchmarks/soak_events.py), as the CI test
`tests/chaos/test_soak.py` does.

How the counting works:

- **sent**: distinct (client, seq) SmashedBatches, from tap queues bound next to the shard
  queues (the clients' own stats die with a SIGKILLed client; the tap sees every publish).
  The clients that exit gracefully print their `batches sent`, summed as a cross-check.
- **applied**: the shards' checkpoints in Redis (`applied`, cumulative over the whole run),
  and per client the checkpoint's `audit` = [batches applied, sum of their seqs mod 2^61].
- **duplicates / lost**: per (shard, client) the audit against the batches sent to that shard
  less those dead-lettered: a count above is a duplicate, below a loss, and a seq sum that
  differs with equal counts means one batch lost and another applied twice.
- **dead-lettered**: `<job>.dead`, drained, by its `x-splitmq-reason` header.
- **sent by rejoined clients**: a client's seqs start at its process's start time in
  microseconds, so the batches of a restarted client at or above its restart time.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Protocol

from benchmarks.common import cnn5_sample_sections
from benchmarks.soak_events import EventChaos
from broker.codec import decode
from broker.errors import DecodeError
from broker.messages import SmashedBatch
from broker.store import WeightStore
from broker.topology import (
    SMASHED_EXCHANGE,
    QueueLimits,
    dead_queue_name,
    job_queues,
    reply_queue_name,
    shard_queue_name,
    shard_routing_key,
)
from broker.transport import REASON_HEADER, Broker, QueueSpec
from services.common.backends import Backends
from services.config.loading import load_settings
from services.config.root import Settings
from services.runtime.processes import child_env
from workers.replica import AUDIT_MODULUS

LOG = logging.getLogger("splitmq.soak")
_SENT_LINE = re.compile(r"(\d+) batches sent")


@dataclass(frozen=True)
class SoakConfig:
    workers: int = 3
    clients: int = 20
    shards: int = 3
    rounds: int = 8
    steps: int = 20
    seed: int = 0
    chaos: bool = True
    kill_every_s: float = 20.0  # a random worker is SIGKILLed this often (+-25%)
    churn: float = 0.3  # share of clients that leave once and rejoin
    sigkill_share: float = 0.5  # of the leaving clients, how many die by SIGKILL (else SIGTERM)
    rejoin_after_s: float = 15.0
    leave_window_s: tuple[float, float] = (10.0, 90.0)  # leaves fall in here, after training began
    broker_restart: bool = False
    restart_at_s: float = 60.0  # after the first round opened
    max_kills: int = 1000
    # Event-driven chaos instead (benchmarks/soak_events.py): one worker SIGKILL and one client
    # leave (SIGTERM) + rejoin, at points of the job, not of the clock; the timed knobs above
    # then do not apply.
    by_events: bool = False
    leave_after_batches: int = 0  # the leaver's batches before it leaves (0: steps // 2)
    max_pause_s: float = 45.0  # the longest the aggregator is paused for a rejoin
    timeout_s: float = 1200.0
    amqp_url: str = "amqp://guest:guest@127.0.0.1:5672/%2F"
    redis_url: str = "redis://127.0.0.1:6379/0"
    # A cluster instead (benchmarks/cluster_chaos.py): its nodes and its Redis Sentinels.
    amqp_urls: tuple[str, ...] = ()
    sentinels: tuple[str, ...] = ()
    min_replicas: int = 0
    out_dir: str = ""  # logs and the aggregator's run directory (default: a temporary one)


@dataclass
class SoakReport:
    job: str
    chaos: bool
    status: str
    wall_s: float = 0.0
    sent: int = 0  # distinct (client, seq) seen on the shard exchange
    sent_by_clients: int = 0  # sum of `batches sent` printed by clients that exited gracefully
    applied: int = 0  # sum of the shards' checkpoint `applied`
    applied_unique: int = 0
    duplicates: int = 0
    lost: int = 0
    checksum_mismatches: int = 0  # (shard, client) pairs whose seq sums differ
    dead_lettered: int = 0
    dead_reasons: dict[str, int] = field(default_factory=dict)
    dead_lettered_batches: int = 0  # of those, SmashedBatches (subtracted from the expected)
    left_in_queues: int = 0
    worker_kills: int = 0
    workers_started: int = 0
    client_leaves_sigterm: int = 0
    client_leaves_sigkill: int = 0
    client_rejoins: int = 0
    rejoined_sent: int = 0  # batches sent by the rejoined incarnations of leaving clients
    aggregator_pauses: int = 0
    aggregator_paused_s: float = 0.0
    broker_restarts: int = 0
    broker_restart_note: str = ""
    versions: int = 0
    final_accuracy: float | None = None
    run_dir: str = ""
    problems: list[str] = field(default_factory=list)


# --- the job ------------------------------------------------------------------------------------


def job_toml(cfg: SoakConfig, job: str, report_dir: Path) -> str:
    nodes = f"amqp_urls = {json.dumps(cfg.amqp_urls)}" if cfg.amqp_urls else ""
    sentinels = (
        f'sentinels = {json.dumps(cfg.sentinels)}\nmaster_name = "splitmq"\n'
        f"min_replicas = {cfg.min_replicas}"
        if cfg.sentinels
        else ""
    )
    return f"""
[broker]
kind = "rabbitmq"
amqp_url = "{cfg.amqp_urls[0] if cfg.amqp_urls else cfg.amqp_url}"
{nodes}
reconnect_give_up_s = 300.0
{cnn5_sample_sections(cfg.redis_url, job, cfg.seed, cfg.rounds, sentinels)}
[algorithm]
name = "sfl"
shards = {cfg.shards}
batch_size = 32
lr = 0.05
momentum = 0.9
max_steps_per_round = {cfg.steps}

[clients]
count = {cfg.clients}
min_to_start = {cfg.clients}
start_timeout_s = 600.0
heartbeat_s = 2.0
heartbeat_ttl_s = 15.0
reply_timeout_s = 20.0

[rounds]
deadline_s = 90.0
quorum = 0.5

[workers]
count = {cfg.workers}
lease_ttl_s = 5.0
checkpoint_every_steps = 10
checkpoint_every_s = 2.0

[metrics]
enabled = false

[report]
dir = "{report_dir}"
"""


class Tap:
    """Durable queues bound next to the shard queues: every SmashedBatch published, as
    (shard, client, seq). Its own thread and connection; survives a broker restart."""

    def __init__(self, backends: Backends, job: str, shards: int) -> None:
        self._backends = backends
        self.names = [f"{job}.soaktap.{s}" for s in range(shards)]
        self._specs = [
            QueueSpec(name, SMASHED_EXCHANGE, shard_routing_key(job, s))
            for s, name in enumerate(self.names)
        ]
        self.sent: set[tuple[int, str, int]] = set()
        self.arrivals: list[float] = []  # monotonic time each new batch was first seen
        self._per_client: Counter[str] = Counter()  # distinct batches, read from other threads
        self.copies = 0
        self._stop = threading.Event()
        self._idle = threading.Event()
        self._broker = backends.open_broker("splitmq-soak-tap")
        self._broker.declare(self._specs)
        self._thread = threading.Thread(target=self._run, name="soak-tap", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        broker = self._broker
        for name in self.names:
            broker.subscribe(name, prefetch=64)
        while not self._stop.is_set():
            delivery = broker.get(0.5)
            if delivery is None:
                self._idle.set()
                continue
            self._idle.clear()
            try:
                message = decode(delivery.body)
            except DecodeError:
                message = None  # not ours to judge: the worker dead-letters it
            if isinstance(message, SmashedBatch):
                self.copies += 1
                key = (message.shard, message.client, message.seq)
                if key not in self.sent:
                    self.sent.add(key)
                    self.arrivals.append(time.monotonic())
                    self._per_client[message.client] += 1
            broker.ack(delivery)

    def count(self, client: str) -> int:
        """Distinct batches seen from `client` so far."""
        return self._per_client[client]

    def drain(self, timeout_s: float = 60.0) -> None:
        """Until the tap queues are empty (everything published so far was seen)."""
        deadline = time.monotonic() + timeout_s
        probe = self._backends.open_broker("splitmq-soak-probe")
        try:
            while time.monotonic() < deadline:
                if sum(probe.queue_depth(n) for n in self.names) == 0 and self._idle.wait(2.0):
                    return
                time.sleep(0.5)
        finally:
            probe.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(30.0)
        for name in self.names:
            self._broker.delete_queue(name)
        self._broker.close()


@dataclass(frozen=True)
class RoleSite:
    """Where a role's processes run: `prefix` goes before their command line (`ip netns exec
    NS`: another host), `env` over their environment (SPLITMQ_AMQP_URL, SPLITMQ_REDIS_URL: the
    broker and store as that host reaches them). The default: here, as the driver."""

    prefix: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)


# The site of each role ("aggregator", "coordinator", "worker", "client").
Placement = Callable[[str], RoleSite]


class Children:
    """The role processes, each `python -m services.cli.main ROLE CONFIG`, logging to a file."""

    def __init__(
        self,
        config: Path,
        env: dict[str, str],
        log_dir: Path,
        placement: Placement | None = None,
    ) -> None:
        self._config = config
        self._env = env
        self._log_dir = log_dir
        self._placement = placement
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self._logs: list[IO[bytes]] = []
        self._starts: Counter[str] = Counter()
        # Wall-clock microseconds of each start: a client's seqs begin at its own start time
        # (services/client/client.py), so they tell its incarnations apart.
        self.started_us: dict[str, list[int]] = {}
        self._retired: list[subprocess.Popen[bytes]] = []  # killed ones, reaped at close

    def start(self, name: str, role: str, *args: str) -> None:
        self._starts[name] += 1
        self.started_us.setdefault(name, []).append(time.time_ns() // 1000)
        if name in self.procs:
            self._retired.append(self.procs[name])
        log = (self._log_dir / f"{name}.{self._starts[name]}.log").open("wb")
        self._logs.append(log)
        site = self._placement(role) if self._placement else RoleSite()
        argv = [sys.executable, "-m", "services.cli.main", role, str(self._config), *args]
        self.procs[name] = subprocess.Popen(
            [*site.prefix, *argv],
            env={**self._env, **site.env},
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def alive(self, prefix: str) -> list[str]:
        return [n for n, p in self.procs.items() if n.startswith(prefix) and p.poll() is None]

    def signal(self, name: str, signum: int) -> None:
        try:
            self.procs[name].send_signal(signum)
        except (ProcessLookupError, OSError):
            pass

    def pids(self) -> set[int]:
        return {p.pid for p in self.procs.values() if p.poll() is None}

    def stop(self, *prefixes: str, grace_s: float = 20.0) -> None:
        """SIGTERM every live process whose name starts with one of `prefixes`, all at once
        (they stop in parallel), and SIGKILL those still there after `grace_s`."""
        names = [n for prefix in prefixes for n in self.alive(prefix)]
        for name in names:
            self.signal(name, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for name in names:
            try:
                self.procs[name].wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                LOG.warning("%s ignored SIGTERM; killing it", name)
                self.signal(name, signal.SIGKILL)
                self.procs[name].wait()

    def close(self) -> None:
        for process in [*self._retired, *self.procs.values()]:
            process.wait()
        for log in self._logs:
            log.close()


# --- the broker restart -------------------------------------------------------------------------


def _rabbitmqctl(*args: str) -> str:
    ctl = shutil.which("rabbitmqctl") or "/usr/sbin/rabbitmqctl"
    done = subprocess.run([ctl, *args], capture_output=True, text=True, timeout=120, check=True)
    return done.stdout


def _our_ports(pids: set[int]) -> set[int]:
    """Local ports of the AMQP connections that `pids` hold (from `ss`)."""
    out = subprocess.run(
        ["ss", "-tnpH", "dport", "= :5672"], capture_output=True, text=True, check=False
    ).stdout
    ports: set[int] = set()
    for line in out.splitlines():
        found = [int(p) for p in re.findall(r"pid=(\d+)", line)]
        if any(p in pids for p in found):
            local = line.split()[3]
            ports.add(int(local.rsplit(":", 1)[1]))
    return ports


def foreign_connections(pids: set[int]) -> list[str]:
    """AMQP connections to this broker that are not ours (empty: a restart hurts nobody)."""
    ours = _our_ports(pids)
    listing = _rabbitmqctl("list_connections", "peer_host", "peer_port", "-q", "--no-table-headers")
    foreign = []
    for line in listing.splitlines():
        parts = line.split()
        if len(parts) >= 2 and parts[1].isdigit() and int(parts[1]) not in ours:
            foreign.append(line.strip())
    return foreign


def restart_broker(pids: set[int], report: SoakReport) -> None:
    try:
        foreign = foreign_connections(pids)
    except (subprocess.SubprocessError, OSError) as exc:
        report.broker_restart_note = f"not done: could not list connections ({exc})"
        return
    if foreign:
        report.broker_restart_note = (
            f"not done: {len(foreign)} other connection(s) on the broker, e.g. {foreign[0]}"
        )
        LOG.warning("broker restart skipped: %s", report.broker_restart_note)
        return
    LOG.warning("restarting RabbitMQ (stop_app, start_app)")
    _rabbitmqctl("stop_app")
    time.sleep(3.0)
    _rabbitmqctl("start_app")
    report.broker_restarts += 1
    report.broker_restart_note = "done: rabbitmqctl stop_app; sleep 3; start_app"


# --- chaos --------------------------------------------------------------------------------------


class WorkerKiller:
    """SIGKILLs a random live worker and starts a replacement under a new name."""

    def __init__(
        self, cfg: SoakConfig, children: Children, report: SoakReport, rng: random.Random
    ) -> None:
        self._children = children
        self._report = report
        self._rng = rng
        self._next_worker = cfg.workers

    def __call__(self) -> str | None:
        """The worker killed, if any was alive."""
        alive = self._children.alive("worker-")
        if not alive:
            return None
        victim = self._rng.choice(alive)
        LOG.info("SIGKILL %s", victim)
        self._children.signal(victim, signal.SIGKILL)
        self._report.worker_kills += 1
        name = f"worker-{self._next_worker}"
        self._next_worker += 1
        self._children.start(name, "worker", "--id", name)
        self._report.workers_started += 1
        return victim


class Chaos:
    """Worker kills every ~kill_every_s, one leave + rejoin per churning client, one restart."""

    def __init__(
        self, cfg: SoakConfig, children: Children, report: SoakReport, rng: random.Random
    ) -> None:
        self._cfg = cfg
        self._children = children
        self._report = report
        self._rng = rng
        self._kill_worker = WorkerKiller(cfg, children, report, rng)
        churners = rng.sample(range(cfg.clients), round(cfg.clients * cfg.churn))
        # Leaves spread over the window, rejoins after a pause.
        self._leaves = {
            i: (rng.uniform(*cfg.leave_window_s), rng.random() < cfg.sigkill_share)
            for i in churners
        }
        self._rejoins: dict[int, float] = {}

    def run(self, stop: threading.Event, started: Callable[[], float | None]) -> None:
        next_kill: float | None = None
        restarted = not self._cfg.broker_restart
        while not stop.wait(0.5):
            t0 = started()
            if t0 is None:
                continue  # chaos starts with training, not while clients are still joining
            now = time.monotonic() - t0
            if next_kill is None:
                next_kill = self._jitter()
            if now >= next_kill and self._report.worker_kills < self._cfg.max_kills:
                self._kill_worker()
                next_kill = now + self._jitter()
            for i, (at, hard) in list(self._leaves.items()):
                if now >= at:
                    del self._leaves[i]
                    self._leave(i, hard)
                    self._rejoins[i] = now + self._cfg.rejoin_after_s
            for i, at in list(self._rejoins.items()):
                if now >= at:
                    del self._rejoins[i]
                    self._start_client(i)
                    self._report.client_rejoins += 1
            if not restarted and now >= self._cfg.restart_at_s:
                restarted = True
                restart_broker(self._children.pids() | {os.getpid()}, self._report)

    def _jitter(self) -> float:
        return self._cfg.kill_every_s * self._rng.uniform(0.75, 1.25)

    def _leave(self, i: int, hard: bool) -> None:
        name = f"client-{i}"
        LOG.info("%s leaves (%s)", name, "SIGKILL" if hard else "SIGTERM")
        self._children.signal(name, signal.SIGKILL if hard else signal.SIGTERM)
        if hard:
            self._report.client_leaves_sigkill += 1
        else:
            self._report.client_leaves_sigterm += 1

    def _start_client(self, i: int) -> None:
        start_client(self._children, i)


def start_client(children: Children, i: int) -> None:
    children.start(f"client-{i}", "client", "--id", f"client-{i}", "--partition", str(i))


# --- counting -----------------------------------------------------------------------------------


def drain_dead(broker: Broker, job: str) -> tuple[Counter[str], set[tuple[int, str, int]]]:
    """Every dead letter's reason, and the batches among them as (shard, client, seq)."""
    reasons: Counter[str] = Counter()
    batches: set[tuple[int, str, int]] = set()
    name = dead_queue_name(job)
    broker.subscribe(name, prefetch=256)
    while (delivery := broker.get(2.0)) is not None:
        reason = str(delivery.headers.get(REASON_HEADER, "") or "(no reason)")
        reasons[reason.split(":", 1)[0][:60]] += 1
        try:
            message = decode(delivery.body)
        except DecodeError:
            message = None
        if isinstance(message, SmashedBatch):
            batches.add((message.shard, message.client, message.seq))
        broker.ack(delivery)
    broker.unsubscribe(name)
    return reasons, batches


def account(
    report: SoakReport,
    settings: Settings,
    backends: Backends,
    sent: set[tuple[int, str, int]],
) -> None:
    job = settings.job.name
    broker = backends.open_broker("splitmq-soak-count")
    store = backends.open_store()
    try:
        report.left_in_queues = sum(
            broker.queue_depth(shard_queue_name(job, s)) for s in range(settings.shards)
        )
        reasons, dead_batches = drain_dead(broker, job)
        report.dead_lettered = sum(reasons.values())
        report.dead_reasons = dict(reasons.most_common())
        report.dead_lettered_batches = len(dead_batches & sent)
        report.sent = len(sent)
        expected: dict[tuple[int, str], list[int]] = {}
        for shard, client, seq in sent - dead_batches:
            expected.setdefault((shard, client), []).append(seq)
        audited: dict[tuple[int, str], tuple[int, int]] = {}
        for shard in range(settings.shards):
            checkpoint = store.load_checkpoint(job, shard)
            if checkpoint is None:
                report.problems.append(f"shard {shard} has no checkpoint")
                continue
            report.applied += int(checkpoint.applied)
            for client, pair in (checkpoint.meta.get("audit") or {}).items():
                audited[(shard, str(client))] = (int(pair[0]), int(pair[1]))
        for key in expected.keys() | audited.keys():
            seqs = expected.get(key, [])
            count, seq_sum = audited.get(key, (0, 0))
            report.applied_unique += min(count, len(seqs))
            report.duplicates += max(0, count - len(seqs))
            report.lost += max(0, len(seqs) - count)
            if count == len(seqs) and seq_sum != sum(seqs) % AUDIT_MODULUS:
                report.checksum_mismatches += 1
                report.problems.append(f"shard {key[0]} client {key[1]}: seq sum differs")
        audit_total = sum(c for c, _ in audited.values())
        if audit_total != report.applied:
            report.problems.append(f"audit counts {audit_total} != applied {report.applied}")
    finally:
        store.close()
        broker.close()


def clear_job(
    settings: Settings, backends: Backends, reply_queues: Sequence[str] | None = None
) -> None:
    """Delete the job's queues and store keys; `reply_queues`: the clients' queues (default:
    those of the soak's clients `client-<i>`)."""
    job = settings.job.name
    if reply_queues is None:
        reply_queues = [reply_queue_name(job, f"client-{i}") for i in range(settings.clients.count)]
    broker = backends.open_broker("splitmq-soak-clear", give_up_after=30.0)
    try:
        limits = QueueLimits(
            settings.broker.shard_queue_max_length, settings.broker.shard_queue_max_bytes
        )
        for spec in job_queues(job, settings.shards, limits):
            broker.delete_queue(spec.name)
        for name in reply_queues:
            broker.delete_queue(name)
    finally:
        broker.close()
    store = backends.open_store()
    try:
        store.delete_job(job)
    finally:
        store.close()


def final_accuracy(run_dir: Path) -> tuple[int, float | None]:
    path = run_dir / "metrics.json"
    if not path.exists():
        return 0, None
    records = json.loads(path.read_text())["records"]
    accs = [r["global_accuracy"] for r in records if r.get("global_accuracy") is not None]
    return len(records), (float(accs[-1]) if accs else None)


# --- one run ------------------------------------------------------------------------------------


class ChaosRunner(Protocol):
    def run(self, stop: threading.Event, started: Callable[[], float | None]) -> None: ...


# Builds the chaos of a run from its processes, report, tap and a store handle of its own.
MakeChaos = Callable[["Children", SoakReport, Tap, WeightStore], ChaosRunner]


def run_once(
    cfg: SoakConfig, make_chaos: MakeChaos | None = None, *, placement: Placement | None = None
) -> SoakReport:
    """One job, with `cfg`'s chaos, or with `make_chaos`'s when given; `placement`: where each
    role runs (default: here, at cfg's URLs, which the driver itself always uses)."""
    job = f"soak-{'chaos' if cfg.chaos else 'calm'}-{uuid.uuid4().hex[:6]}"
    out = Path(cfg.out_dir or tempfile.mkdtemp(prefix="splitmq-soak-")) / job
    out.mkdir(parents=True, exist_ok=True)
    config = out / "job.toml"
    config.write_text(job_toml(cfg, job, out / "runs"))
    settings = load_settings(config, {})
    backends = Backends(settings.broker, settings.store)
    report = SoakReport(job=job, chaos=cfg.chaos, status="started")
    run_dir = out / "run"
    report.run_dir = str(run_dir)
    env = child_env(os.environ, workers=cfg.workers, clients=cfg.clients)
    # Each role process one torch thread: 2 cores shared by ~25 processes.
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("MKL_NUM_THREADS", "1")
    clear_job(settings, backends)
    tap = Tap(backends, job, cfg.shards)
    tap.start()
    children = Children(config, env, out, placement)
    rng = random.Random(cfg.seed)
    stop = threading.Event()
    started_at: list[float] = []

    def training_started() -> float | None:
        # The first batch on the tap: round 1 is training, every client has joined.
        if not started_at and tap.copies > 0:
            started_at.append(time.monotonic())
        return started_at[0] if started_at else None

    chaos_store = backends.open_store()
    chaos: ChaosRunner | None = (
        make_chaos(children, report, tap, chaos_store)
        if make_chaos is not None
        else _chaos(cfg, children, report, rng, tap, chaos_store, job)
    )
    chaos_thread = (
        threading.Thread(target=chaos.run, args=(stop, training_started), daemon=True)
        if chaos
        else None
    )
    t0 = time.monotonic()
    try:
        children.start("aggregator", "aggregator", "--run-dir", str(run_dir), "--no-summary")
        children.start("coordinator", "coordinator")
        for i in range(cfg.workers):
            children.start(f"worker-{i}", "worker", "--id", f"worker-{i}")
        for i in range(cfg.clients):
            start_client(children, i)
        if chaos_thread is not None:
            chaos_thread.start()
        aggregator = children.procs["aggregator"]
        while aggregator.poll() is None and time.monotonic() - t0 < cfg.timeout_s:
            time.sleep(0.25)
            if chaos is None:
                training_started()
        if aggregator.poll() is None:
            report.status = "timeout"
        else:
            report.status = "finished" if aggregator.returncode == 0 else "aggregator failed"
        stop.set()
        if chaos_thread is not None:
            chaos_thread.join(60.0)
        # Clients take the job's end and leave; what they published last is served.
        deadline = time.monotonic() + 60.0
        while children.alive("client-") and time.monotonic() < deadline:
            time.sleep(0.5)
        children.stop("client-")
        _wait_queues_empty(backends, job, cfg.shards, 60.0)
        children.stop("worker-", "coordinator", "aggregator")
        report.wall_s = time.monotonic() - t0
        tap.drain()
    finally:
        stop.set()
        for name in children.alive(""):
            children.signal(name, signal.SIGKILL)
        children.close()
        chaos_store.close()
    report.sent_by_clients = _logged_sends(out)
    sent = set(tap.sent)
    report.rejoined_sent = rejoined_sends(sent, children.started_us)
    account(report, settings, backends, sent)
    tap.close()
    report.versions, report.final_accuracy = final_accuracy(run_dir)
    clear_job(settings, backends)
    return report


def _chaos(
    cfg: SoakConfig,
    children: Children,
    report: SoakReport,
    rng: random.Random,
    tap: Tap,
    store: WeightStore,
    job: str,
) -> Chaos | EventChaos | None:
    if not cfg.chaos:
        return None
    if not cfg.by_events:
        return Chaos(cfg, children, report, rng)
    return EventChaos(
        cfg,
        children,
        report,
        rng,
        tap,
        store,
        job=job,
        kill_worker=WorkerKiller(cfg, children, report, rng),
        start_client=lambda i: start_client(children, i),
    )


def rejoined_sends(sent: set[tuple[int, str, int]], started_us: dict[str, list[int]]) -> int:
    """Batches sent by a client's later incarnations: its seqs start at its process's start
    time in microseconds, so those at or above its second start are the rejoined ones'."""
    rejoined = {name: starts[1] for name, starts in started_us.items() if len(starts) > 1}
    return sum(1 for _, client, seq in sent if client in rejoined and seq >= rejoined[client])


def _wait_queues_empty(backends: Backends, job: str, shards: int, timeout_s: float) -> None:
    broker = backends.open_broker("splitmq-soak-wait")
    try:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if all(broker.queue_depth(shard_queue_name(job, s)) == 0 for s in range(shards)):
                return
            time.sleep(1.0)
    finally:
        broker.close()


def _logged_sends(out: Path) -> int:
    total = 0
    for log in out.glob("client-*.log"):
        found = _SENT_LINE.findall(log.read_text(errors="replace"))
        total += int(found[-1]) if found else 0
    return total


# --- the report ---------------------------------------------------------------------------------


def table(chaos: SoakReport, calm: SoakReport | None) -> str:
    def acc(r: SoakReport | None) -> str:
        return "-" if r is None or r.final_accuracy is None else f"{r.final_accuracy:.3f}"

    reasons = ", ".join(f"{k} {v}" for k, v in chaos.dead_reasons.items()) or "none"
    rows = [
        ("status", f"{chaos.status} in {chaos.wall_s:.0f} s ({chaos.versions} versions)"),
        ("worker SIGKILLs / workers started", f"{chaos.worker_kills} / {chaos.workers_started}"),
        (
            "client leaves (SIGTERM / SIGKILL) / rejoins",
            f"{chaos.client_leaves_sigterm} / {chaos.client_leaves_sigkill} / "
            f"{chaos.client_rejoins}",
        ),
        ("batches sent by rejoined clients", f"{chaos.rejoined_sent}"),
        (
            "aggregator pauses (waiting for a rejoin)",
            f"{chaos.aggregator_pauses} ({chaos.aggregator_paused_s:.1f} s)",
        ),
        ("broker restarts", f"{chaos.broker_restarts} ({chaos.broker_restart_note or 'off'})"),
        ("batches sent (distinct client, seq)", f"{chaos.sent}"),
        ("  printed by gracefully exiting clients", f"{chaos.sent_by_clients}"),
        ("batches applied (checkpoints)", f"{chaos.applied}"),
        ("duplicates applied", f"**{chaos.duplicates}**"),
        ("lost", f"**{chaos.lost}**"),
        ("seq-sum mismatches", f"{chaos.checksum_mismatches}"),
        (
            "dead-lettered (all) / of them batches",
            f"{chaos.dead_lettered} / {chaos.dead_lettered_batches}",
        ),
        ("dead-letter reasons", reasons),
        ("left in shard queues", f"{chaos.left_in_queues}"),
        ("final accuracy: soak / undisturbed", f"{acc(chaos)} / {acc(calm)}"),
    ]
    lines = ["| | |", "|---|---|"] + [f"| {k} | {v} |" for k, v in rows]
    return "\n".join(lines)


_SHAPE = ("workers", "clients", "shards", "rounds", "steps", "seed")


def add_job_arguments(parser: argparse.ArgumentParser, defaults: SoakConfig) -> None:
    """--workers, --clients, --shards, --rounds, --steps and --seed, defaulting to `defaults`'."""
    for name in _SHAPE:
        parser.add_argument(f"--{name}", type=int, default=getattr(defaults, name))


def job_shape(args: argparse.Namespace) -> dict[str, int]:
    """What `add_job_arguments` parsed, as `SoakConfig` fields."""
    return {name: int(getattr(args, name)) for name in _SHAPE}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_job_arguments(parser, SoakConfig())
    parser.add_argument("--kill-every", type=float, default=20.0)
    parser.add_argument("--churn", type=float, default=0.3)
    parser.add_argument("--rejoin-after", type=float, default=15.0)
    parser.add_argument(
        "--by-events",
        action="store_true",
        help="one worker kill and one client leave + rejoin at points of the job, not timed",
    )
    parser.add_argument("--broker-restart", action="store_true")
    parser.add_argument("--restart-at", type=float, default=60.0)
    parser.add_argument("--no-baseline", action="store_true", help="skip the undisturbed run")
    parser.add_argument("--timeout", type=float, default=1200.0)
    parser.add_argument("--out", default="")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("pika").setLevel(logging.WARNING)
    cfg = SoakConfig(
        **job_shape(args),
        kill_every_s=args.kill_every,
        churn=args.churn,
        rejoin_after_s=args.rejoin_after,
        by_events=args.by_events,
        broker_restart=args.broker_restart,
        restart_at_s=args.restart_at,
        timeout_s=args.timeout,
        out_dir=args.out,
    )
    load_before = os.getloadavg()
    chaos = run_once(cfg)
    LOG.info("soak: %s", asdict(chaos))
    calm = None if args.no_baseline else run_once(SoakConfig(**{**asdict(cfg), "chaos": False}))
    print(
        f"machine: {platform.system()} {platform.machine()}, {os.cpu_count()} CPUs, "
        f"Python {platform.python_version()}; load average before "
        f"{' '.join(f'{x:.1f}' for x in load_before)}, after "
        f"{' '.join(f'{x:.1f}' for x in os.getloadavg())}"
    )
    print(table(chaos, calm))
    for problem in chaos.problems:
        print("problem:", problem)
    if args.json is not None:
        args.json.write_text(
            json.dumps(
                {
                    "config": asdict(cfg),
                    "chaos": asdict(chaos),
                    "calm": asdict(calm) if calm else None,
                },
                indent=2,
            )
        )
    ok = chaos.status == "finished" and chaos.lost == 0 and chaos.duplicates == 0
    return 0 if ok and not chaos.checksum_mismatches else 1


if __name__ == "__main__":
    sys.exit(main())
