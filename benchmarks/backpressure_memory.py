"""Back-pressure and memory (design §6, issue 5 item 4): clients that far outpace the one worker
are refused by the bounded shard queue, back off and retry, and no role's memory grows.

    python -m benchmarks.backpressure_memory --clients 12 --rounds 10 --local-epochs 4 \
        --max-length 8 --json backpressure.json --write-docs

The job is local-loss SFL (cnn5 cut after block1, Fashion-MNIST sample): its clients train
their block with an auxiliary head and publish activations without waiting for a gradient, so
nothing but the queue bound slows them down, while the one worker trains the four server
blocks on every batch. The shard queue holds `--max-length` messages (`[broker]
shard_queue_max_length`, reject-publish). Every role is its own `splitmq <role>` process over the
real RabbitMQ and Redis, started as `splitmq up` and `benchmarks.soak` do.

Every `--sample` seconds it reads each role process's resident memory (`VmRSS` in
/proc/PID/status) and the depths of the job's queues. Per role it reports the RSS when training
began (the first batch on the wire), the highest, the RSS when the last round closed, and the
least-squares slope over the second half of training. The refusals are the clients' own
`backpressure_retries`, which each prints as it leaves; sent / applied / duplicates / lost are
counted as in the soak run (tap queues next to the shard queue, the shard checkpoint's audit).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import statistics
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path

from benchmarks.common import (
    cnn5_sample_sections,
    machine_line,
    process_cpu_seconds,
    write_section,
)
from benchmarks.soak import (
    Children,
    SoakReport,
    Tap,
    account,
    clear_job,
    final_accuracy,
    start_client,
)
from broker.errors import BrokerError
from broker.rabbitmq import RabbitMQBroker
from broker.store import WeightStore
from broker.topology import (
    control_queue_name,
    reply_queue_name,
    shard_queue_name,
    updates_queue_name,
)
from broker.transport import Broker
from services.common.backends import Backends
from services.common.leases import worker_beat
from services.config.loading import load_settings
from services.runtime.processes import child_env

LOG = logging.getLogger("splitmq.backpressure")
RELIABILITY_DOC = Path(__file__).resolve().parent.parent / "docs" / "reliability.md"
SECTION = "backpressure-memory"
_REFUSALS_LINE = re.compile(r"(\d+) back-pressure refusals")
_MIB = 1024 * 1024


@dataclass(frozen=True)
class PressureConfig:
    clients: int = 12
    workers: int = 1
    rounds: int = 10  # about 3 minutes of training on 2 loaded cores
    local_epochs: int = 4  # 6,000 samples / 12 clients / 32 a batch: 15 steps an epoch
    max_length: int = 8  # the shard queue's bound, in messages
    sample_s: float = 1.0
    seed: int = 0
    timeout_s: float = 900.0
    amqp_url: str = "amqp://guest:guest@127.0.0.1:5672/%2F"
    redis_url: str = "redis://127.0.0.1:6379/0"
    out_dir: str = ""


@dataclass
class Sample:
    t: float  # seconds since the roles were started
    rss: dict[str, int]  # role name -> VmRSS in bytes (live processes only)
    cpu: dict[str, float]  # role name -> CPU seconds used so far
    depths: dict[str, int]  # "shard", "replies" (all clients together), "updates", "control"
    busy: dict[str, float]  # worker id -> busy fraction from its last heartbeat (workers/worker.py)
    load1: float


@dataclass
class RoleMemory:
    role: str
    start_mib: float
    max_mib: float
    end_mib: float
    slope_mib_per_min: float  # least squares over the second half of training
    cpu_share: float  # CPU seconds over training seconds (1.0: one core all the time)


@dataclass
class PressureReport:
    job: str
    status: str = "started"
    wall_s: float = 0.0
    training_s: float = 0.0
    refusals: int = 0  # summed over the clients' printed backpressure_retries
    refusals_per_client: list[int] = field(default_factory=list)
    clients_reporting: int = 0
    shard_depth_max: int = 0
    shard_depth_median: float = 0.0
    at_bound_share: float = 0.0  # of the training samples, those with the shard queue full
    replies_depth_max: int = 0
    load1_max: float = 0.0
    worker_busy: float | None = None  # mean of the workers' busy fractions while training
    servers: str = ""  # RabbitMQ and Redis versions, for the machine line
    roles: list[RoleMemory] = field(default_factory=list)
    counts: SoakReport | None = None


# --- sampling -----------------------------------------------------------------------------------


def rss_bytes(pid: int) -> int | None:
    """Resident set size of `pid` from /proc (None once it is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except (FileNotFoundError, ProcessLookupError):
        return None
    return None


class Sampler:
    """Every `interval` seconds: each live role's RSS and the job's queue depths."""

    def __init__(
        self, children: Children, backends: Backends, job: str, clients: int, interval: float
    ) -> None:
        self._children = children
        self._broker: Broker = backends.open_broker("splitmq-backpressure-probe")
        self._store: WeightStore = backends.open_store()
        self._job = job
        self._queues = {
            "shard": [shard_queue_name(job, 0)],
            "replies": [reply_queue_name(job, f"client-{i}") for i in range(clients)],
            "updates": [updates_queue_name(job)],
            "control": [control_queue_name(job)],
        }
        self._interval = interval
        self._t0 = time.monotonic()
        self.samples: list[Sample] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sampler", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30.0)
        self._broker.close()
        self._store.close()

    def now(self) -> float:
        return time.monotonic() - self._t0

    def _run(self) -> None:
        next_at = time.monotonic()
        while not self._stop.is_set():
            rss: dict[str, int] = {}
            cpu: dict[str, float] = {}
            for name, process in list(self._children.procs.items()):
                if process.poll() is None and (value := rss_bytes(process.pid)) is not None:
                    rss[name] = value
                    try:
                        cpu[name] = process_cpu_seconds(process.pid)
                    except (FileNotFoundError, ProcessLookupError):
                        pass  # it exited between the two reads
            self.samples.append(
                Sample(self.now(), rss, cpu, self._depths(), self._busy(), os.getloadavg()[0])
            )
            next_at += self._interval
            self._stop.wait(max(0.0, next_at - time.monotonic()))

    def _busy(self) -> dict[str, float]:
        reports = (worker_beat(m) for m in self._store.live_members(self._job).values())
        return {r.worker: r.busy for r in reports if r is not None and r.busy is not None}

    def _depths(self) -> dict[str, int]:
        depths: dict[str, int] = {}
        for key, names in self._queues.items():
            total = 0
            for name in names:
                try:
                    total += self._broker.queue_depth(name)
                except BrokerError:
                    continue  # not declared yet (a client still starting)
            depths[key] = total
        return depths


# --- the job ------------------------------------------------------------------------------------


def job_toml(cfg: PressureConfig, job: str, report_dir: Path) -> str:
    return f"""
[broker]
kind = "rabbitmq"
amqp_url = "{cfg.amqp_url}"
shard_queue_max_length = {cfg.max_length}
{cnn5_sample_sections(cfg.redis_url, job, cfg.seed, cfg.rounds)}
[algorithm]
name = "local_loss_sfl"
batch_size = 32
lr = 0.05
momentum = 0.9
local_epochs = {cfg.local_epochs}

[clients]
count = {cfg.clients}
min_to_start = {cfg.clients}
start_timeout_s = 600.0
heartbeat_s = 2.0
heartbeat_ttl_s = 60.0

[rounds]
# Refused clients take longer than the default deadline; closing a round on them is not
# what this measures.
deadline_s = 900.0
quorum = 1.0

[workers]
count = {cfg.workers}
checkpoint_every_steps = 20
checkpoint_every_s = 5.0

[metrics]
enabled = false

[report]
dir = "{report_dir}"
plots = false
"""


def run(cfg: PressureConfig) -> tuple[PressureReport, list[Sample]]:
    job = f"pressure-{uuid.uuid4().hex[:6]}"
    out = Path(cfg.out_dir or tempfile.mkdtemp(prefix="splitmq-pressure-")) / job
    out.mkdir(parents=True, exist_ok=True)
    config = out / "job.toml"
    config.write_text(job_toml(cfg, job, out / "runs"))
    settings = load_settings(config, {})
    backends = Backends(settings.broker, settings.store)
    report = PressureReport(job=job, servers=server_versions(backends))
    run_dir = out / "run"
    env = child_env(os.environ, workers=cfg.workers, clients=cfg.clients)
    # One torch thread per role: a dozen processes share the cores.
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("MKL_NUM_THREADS", "1")
    clear_job(settings, backends)
    tap = Tap(backends, job, 1)
    tap.start()
    children = Children(config, env, out)
    sampler = Sampler(children, backends, job, cfg.clients, cfg.sample_s)
    training: list[float] = []  # sampler times: first batch on the wire, aggregator exit
    t0 = time.monotonic()
    try:
        sampler.start()
        children.start("aggregator", "aggregator", "--run-dir", str(run_dir), "--no-summary")
        children.start("coordinator", "coordinator")
        for i in range(cfg.workers):
            children.start(f"worker-{i}", "worker", "--id", f"worker-{i}")
        for i in range(cfg.clients):
            start_client(children, i)
        aggregator = children.procs["aggregator"]
        while aggregator.poll() is None and time.monotonic() - t0 < cfg.timeout_s:
            if not training and tap.copies > 0:
                training.append(sampler.now())
            time.sleep(0.2)
        training.append(sampler.now())
        if aggregator.poll() is None:
            report.status = "timeout"
        else:
            report.status = "finished" if aggregator.returncode == 0 else "aggregator failed"
        deadline = time.monotonic() + 60.0
        while children.alive("client-") and time.monotonic() < deadline:
            time.sleep(0.5)
        children.stop("client-")
        children.stop("worker-")
        children.stop("coordinator")
        report.wall_s = time.monotonic() - t0
        tap.drain()
    finally:
        sampler.stop()
        for name in children.alive(""):
            children.stop(name)
        children.close()
    counts = SoakReport(job=job, chaos=False, status=report.status, run_dir=str(run_dir))
    account(counts, settings, backends, set(tap.sent))
    tap.close()
    counts.versions, counts.final_accuracy = final_accuracy(run_dir)
    report.counts = counts
    clear_job(settings, backends)
    _refusals(report, out)
    if len(training) == 2:
        summarise(report, sampler.samples, training[0], training[1], cfg.max_length)
    return report, sampler.samples


def _refusals(report: PressureReport, out: Path) -> None:
    for log in sorted(out.glob("client-*.log")):
        found = _REFUSALS_LINE.findall(log.read_text(errors="replace"))
        if found:
            report.refusals_per_client.append(int(found[-1]))
    report.refusals = sum(report.refusals_per_client)
    report.clients_reporting = len(report.refusals_per_client)


# --- the numbers --------------------------------------------------------------------------------


def slope_per_min(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of (seconds, MiB) points, in MiB per minute (0 for < 2 points)."""
    if len(points) < 2:
        return 0.0
    mean_t = statistics.fmean(t for t, _ in points)
    mean_v = statistics.fmean(v for _, v in points)
    var = sum((t - mean_t) ** 2 for t, _ in points)
    if var == 0:
        return 0.0
    cov = sum((t - mean_t) * (v - mean_v) for t, v in points)
    return cov / var * 60.0


def summarise(
    report: PressureReport, samples: list[Sample], start: float, end: float, bound: int
) -> None:
    window = [s for s in samples if start <= s.t <= end]
    report.training_s = end - start
    if not window:
        return
    shard = [s.depths.get("shard", 0) for s in window]
    report.shard_depth_max = max(shard)
    report.shard_depth_median = statistics.median(shard)
    report.at_bound_share = sum(d >= bound for d in shard) / len(shard)
    report.replies_depth_max = max(s.depths.get("replies", 0) for s in window)
    report.load1_max = max(s.load1 for s in window)
    busy = [b for s in window for b in s.busy.values()]
    report.worker_busy = statistics.fmean(busy) if busy else None
    middle = start + (end - start) / 2
    names = sorted({n for s in window for n in s.rss}, key=_role_order)
    for name in names:
        series = [(s.t, s.rss[name] / _MIB) for s in window if name in s.rss]
        if not series:
            continue
        cpu = [(s.t, s.cpu[name]) for s in window if name in s.cpu]
        cpu_share = (cpu[-1][1] - cpu[0][1]) / (cpu[-1][0] - cpu[0][0]) if len(cpu) > 1 else 0.0
        report.roles.append(
            RoleMemory(
                role=name,
                start_mib=series[0][1],
                max_mib=max(v for _, v in series),
                end_mib=series[-1][1],
                slope_mib_per_min=slope_per_min([p for p in series if p[0] >= middle]),
                cpu_share=cpu_share,
            )
        )


def _role_order(name: str) -> tuple[int, int]:
    kinds = ["coordinator", "aggregator", "worker", "client"]
    kind, _, index = name.partition("-")
    return kinds.index(kind) if kind in kinds else len(kinds), int(index or 0)


def role_rows(roles: list[RoleMemory]) -> list[str]:
    """The services one row each; the clients as their median and their highest per column."""

    def row(name: str, start: float, high: float, end: float, slope: float, cpu: float) -> str:
        return (
            f"| {name} | {start:.0f} | {high:.0f} | {end:.0f} | {slope:+.2f} | {100 * cpu:.0f}% |"
        )

    rows = [
        row(r.role, r.start_mib, r.max_mib, r.end_mib, r.slope_mib_per_min, r.cpu_share)
        for r in roles
        if not r.role.startswith("client-")
    ]
    clients = [r for r in roles if r.role.startswith("client-")]
    if clients:
        columns = [
            [r.start_mib for r in clients],
            [r.max_mib for r in clients],
            [r.end_mib for r in clients],
            [r.slope_mib_per_min for r in clients],
            [r.cpu_share for r in clients],
        ]
        median = [statistics.median(c) for c in columns]
        # The slope's worst is the one furthest from flat, either way.
        highest = [max(c) for c in columns]
        highest[3] = max(columns[3], key=abs)
        rows.append(row(f"clients ({len(clients)}), median", *median))
        rows.append(row(f"clients ({len(clients)}), highest", *highest))
    return rows


def markdown(
    cfg: PressureConfig,
    report: PressureReport,
    command: str,
    machine: str,
    load: tuple[tuple[float, ...], tuple[float, ...]],
) -> str:
    counts = report.counts or SoakReport(job=report.job, chaos=False, status=report.status)
    spread = (
        f"{min(report.refusals_per_client)}-{max(report.refusals_per_client)} per client"
        if report.refusals_per_client
        else "no client reported"
    )
    worker_cpu = sum(r.cpu_share for r in report.roles if r.role.startswith("worker-"))
    clients_cpu = sum(r.cpu_share for r in report.roles if r.role.startswith("client-"))
    busy = "-" if report.worker_busy is None else f"{100 * report.worker_busy:.0f}%"
    lines = [
        "```bash",
        command,
        "```",
        "",
        f"{machine}; load average {' '.join(f'{x:.1f}' for x in load[0])} before, "
        f"{' '.join(f'{x:.1f}' for x in load[1])} after, 1-minute peak {report.load1_max:.1f} "
        f"during training. local_loss_sfl, cnn5 cut after block1, {cfg.clients} clients, "
        f"{cfg.workers} worker, {cfg.rounds} rounds of {cfg.local_epochs} local epochs, "
        f"shard queue bound {cfg.max_length} messages, sampled every {cfg.sample_s:g} s.",
        "",
        "| | |",
        "|---|---|",
        f"| status | {report.status}: training {report.training_s:.0f} s of "
        f"{report.wall_s:.0f} s ({counts.versions} versions, accuracy "
        f"{'-' if counts.final_accuracy is None else f'{counts.final_accuracy:.3f}'}) |",
        f"| **back-pressure refusals seen by the clients** | **{report.refusals:,}** "
        f"({spread}; {report.clients_reporting} of {cfg.clients} clients reported) |",
        f"| shard queue depth: highest / median (bound {cfg.max_length}) | "
        f"{report.shard_depth_max} / {report.shard_depth_median:g} |",
        f"| samples with the shard queue full | {100 * report.at_bound_share:.0f}% |",
        f"| reply queues, all clients: highest depth | {report.replies_depth_max} |",
        f"| batches sent (distinct client, seq) / applied | {counts.sent:,} / {counts.applied:,} |",
        f"| **duplicates applied / lost** | **{counts.duplicates} / {counts.lost}** |",
        f"| dead-lettered / left in the shard queue | {counts.dead_lettered} / "
        f"{counts.left_in_queues} |",
        f"| CPU during training, share of one core: worker / all clients together | "
        f"{100 * worker_cpu:.0f}% / {100 * clients_cpu:.0f}% |",
        f"| worker busy (not waiting for a delivery), mean of its heartbeats | {busy} |",
        "",
        "| role | RSS at start of training (MiB) | highest (MiB) | at end (MiB) "
        "| slope, 2nd half (MiB/min) | CPU, share of one core |",
        "|---|---|---|---|---|---|",
        *role_rows(report.roles),
    ]
    return "\n".join(lines)


def server_versions(backends: Backends) -> str:
    parts = []
    broker = backends.open_broker("splitmq-backpressure-info")
    try:
        if isinstance(broker, RabbitMQBroker):
            info = broker.server_info()
            parts.append(f"{info.product} {info.version}")
    finally:
        broker.close()
    try:
        import redis

        client = redis.Redis.from_url(backends.store_settings.redis_url)
        parts.append(f"Redis {client.info()['redis_version']}")
        client.close()
    except Exception as exc:  # only a label in the docs: never fail the run for it
        LOG.debug("no Redis version: %s", exc)
    return ", ".join(parts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=PressureConfig.clients)
    parser.add_argument("--workers", type=int, default=PressureConfig.workers)
    parser.add_argument("--rounds", type=int, default=PressureConfig.rounds)
    parser.add_argument("--local-epochs", type=int, default=PressureConfig.local_epochs)
    parser.add_argument("--max-length", type=int, default=PressureConfig.max_length)
    parser.add_argument("--sample", type=float, default=PressureConfig.sample_s)
    parser.add_argument("--seed", type=int, default=PressureConfig.seed)
    parser.add_argument("--timeout", type=float, default=PressureConfig.timeout_s)
    parser.add_argument("--out", default="")
    parser.add_argument("--json", type=Path, default=None, help="the report and every sample")
    parser.add_argument("--write-docs", action="store_true", help=f"rewrite {SECTION} section")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    # Passive declares of queues not declared yet (the depth probe) are expected misses.
    logging.getLogger("pika").setLevel(logging.ERROR)
    cfg = PressureConfig(
        clients=args.clients,
        workers=args.workers,
        rounds=args.rounds,
        local_epochs=args.local_epochs,
        max_length=args.max_length,
        sample_s=args.sample,
        seed=args.seed,
        timeout_s=args.timeout,
        out_dir=args.out,
    )
    load_before = os.getloadavg()
    report, samples = run(cfg)
    load_after = os.getloadavg()
    machine = machine_line(*([report.servers] if report.servers else []))
    command = "python -m benchmarks.backpressure_memory " + " ".join(sys.argv[1:])
    text = markdown(cfg, report, command.strip(), machine, (load_before, load_after))
    print(text)
    if args.json is not None:
        args.json.write_text(
            json.dumps(
                {
                    "config": asdict(cfg),
                    "report": asdict(report),
                    "samples": [asdict(s) for s in samples],
                },
                indent=1,
            )
        )
    if args.write_docs:
        write_section(SECTION, text, RELIABILITY_DOC)
    counts = report.counts
    ok = (
        report.status == "finished"
        and counts is not None
        and counts.lost == 0
        and counts.duplicates == 0
        and report.shard_depth_max <= cfg.max_length
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
