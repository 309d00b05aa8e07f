"""Cross-device scale (issue 13): hundreds to a thousand live clients on client hosts, over the
real RabbitMQ and Redis, with per-round sampling and churn from an availability trace.

    SPLITMQ_DATA_DIR=../shared/data python -m benchmarks.scale_clients \
        --clients 100 300 1000 --algorithms sfl fedavg --json scale.json --write-docs

Each point is one job as separate processes: the aggregator, the coordinator, two workers
(split algorithms only) and `splitmq clients` hosts of at most `--per-host` clients each. The
clients are online as a generated trace says (`--churn`, the model of docs/traces.md with a
high online fraction, compressed so devices go offline mid-round and come back; `--churn
none`: always online). Measured:

- **RSS** of every process, sampled from /proc every second (the peak of each, and the peak of
  the hosts' sum), the broker's (the beam process, and `rabbitmqctl status` at the end) and
  Redis's `used_memory`.
- **rounds per minute** from the first round's opening to the last version (metrics.json).
- **join latency** (first Join to Welcome, per client session) and **heartbeat latency** (a
  HostHeartbeat's publish to its confirm) percentiles, from the hosts' `--stats-file`s.
- **messages/s** through the hosts, both ways (everything their clients and heartbeats sent,
  everything their dispatchers routed) over the training time.
- **sent = applied per client**: split algorithms count every SmashedBatch on tap queues next
  to the shard queues and compare, per (shard, client), with the shards' checkpoint audits
  (benchmarks/soak.py, `account`); FedAvg compares each host's uploaded rounds with the
  updates the aggregator counted plus those refused as late.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from benchmarks.common import DOCS_PATH, machine_line, percentile, write_section
from benchmarks.soak import Children, SoakReport, Tap, account, clear_job
from broker.topology import host_queue_name
from services.client.trace_model import DiurnalModel, generate
from services.client.traces import Trace
from services.common.backends import Backends
from services.config.loading import load_settings
from services.config.root import Settings

LOG = logging.getLogger("benchmarks.scale_clients")
_CTL_EVERY_S = 15.0
SECTION = "scale-clients"
PLOT = Path("scale_clients.png")


@dataclass
class ScaleConfig:
    clients: int = 200
    algorithm: str = "sfl"
    fraction: float = 0.1
    rounds: int = 5
    per_host: int = 500
    # `splitmq client` processes beside the hosts, on the partitions after the hosts' clients.
    standalone: int = 0
    workers: int = 2
    churn: str = "trace"  # "trace" or "none"
    dataset: str = "fashion_mnist"
    batch_size: int = 32
    seed: int = 0
    amqp_url: str = "amqp://guest:guest@127.0.0.1:5672/%2F"
    redis_url: str = "redis://127.0.0.1:6379/0"
    timeout_s: float = 900.0
    out_dir: str = ""


@dataclass
class ScaleReport:
    clients: int
    algorithm: str
    hosts: int
    status: str = "started"
    wall_s: float = 0.0
    joined: int = 0  # clients welcomed at least once
    sessions: int = 0
    offline_events: int = 0  # intervals that ended while the job ran
    rounds: int = 0
    rounds_per_min: float = 0.0
    final_accuracy: float | None = None
    peak_rss_mib: dict[str, float] = field(default_factory=dict)
    hosts_rss_mib: float = 0.0  # peak of the hosts' summed RSS
    per_client_kib: float = 0.0  # hosts' RSS less one idle host's, per client
    broker_rss_mib: float = 0.0
    broker_status_mib: float = 0.0  # `rabbitmqctl status`: total memory at the end
    broker_connections: int = 0
    broker_channels: int = 0
    broker_queues: int = 0
    redis_used_mib: float = 0.0
    redis_peak_mib: float = 0.0
    join_ms: dict[str, float] = field(default_factory=dict)
    heartbeat_ms: dict[str, float] = field(default_factory=dict)
    messages_per_s: float = 0.0
    sent: int = 0
    applied: int = 0
    lost: int = 0
    duplicates: int = 0
    dead_lettered: int = 0
    dead_reasons: dict[str, int] = field(default_factory=dict)  # by reason code
    clients_sent_ne_applied: int = 0
    standalone_rounds: int = 0  # rounds the standalone clients' logs say they uploaded
    standalone_finished: int = 0  # standalone clients that ended with the job ("finished")
    uploaded: int = 0  # FedAvg: rounds the clients uploaded
    counted: int = 0  # FedAvg: updates in versions
    load_before: float = 0.0
    command: str = ""  # the command line that measured it
    problems: list[str] = field(default_factory=list)


def job_toml(cfg: ScaleConfig, job: str, report_dir: Path) -> str:
    data_dir = os.environ.get("SPLITMQ_DATA_DIR", "")
    return f"""
[broker]
kind = "rabbitmq"
amqp_url = "{cfg.amqp_url}"
reconnect_give_up_s = 300.0

[store]
kind = "redis"
redis_url = "{cfg.redis_url}"

[job]
name = "{job}"
seed = {cfg.seed}
rounds = {cfg.rounds}

[model]
name = "cnn5"
cut = "block1"

[data]
dataset = "{cfg.dataset}"
dir = "{data_dir}"
partition = "iid"
eval_samples = 2000

[algorithm]
name = "{cfg.algorithm}"
batch_size = {cfg.batch_size}
lr = 0.05
momentum = 0.9

[clients]
count = {cfg.clients + cfg.standalone}
fraction = {cfg.fraction}
min_to_start = {max(1, int(cfg.clients * 0.8))}
start_timeout_s = 300.0
heartbeat_s = 2.0
heartbeat_ttl_s = 8.0
reply_timeout_s = 20.0

[rounds]
deadline_s = 60.0
quorum = 0.5

[workers]
count = {cfg.workers}
lease_ttl_s = 10.0

[metrics]
enabled = false

[report]
dir = "{report_dir}"
"""


# The early leavers' departure (host time: they start first and have joined by then) and
# their time offline.
_EARLY_LEAVE_S = 4.0
_EARLY_GAP_S = 2.0


def churn_trace(cfg: ScaleConfig, expected_s: float, path: Path) -> Trace:
    """A trace where most clients are online most of the time and sessions are short next to
    the run, so clients drop out of rounds and come back: the docs' diurnal model, compressed
    so that a model day lasts about the run, except that every device is online from the start
    through its first session (so that every client joins, as the acceptance asks)."""
    model = DiurnalModel(
        peak_fraction=0.95,
        trough_fraction=0.85,
        session_median_s=4 * 3_600.0,
        session_sigma=0.8,
        tz_spread_h=8.0,
    )
    generated = generate(model, cfg.clients, expected_s * 4, day_s=expected_s, seed=cfg.seed)
    sessions: dict[int | str, tuple[tuple[float, float], ...]] = {}
    for i in range(cfg.clients):
        spans = list(generated.intervals(i)) or [(0.0, math.inf)]
        spans[0] = (0.0, spans[0][1])
        spans[-1] = (spans[-1][0], math.inf)  # past the trace's end: online
        sessions[i] = tuple(spans)
    # A few devices leave soon after the joins and come back, so that every run has churn
    # however fast its rounds go (the model's first departures scale with `expected_s`, an
    # estimate a faster machine or build beats).
    for i in range(max(2, cfg.clients // 50)):
        leave = _EARLY_LEAVE_S + 0.1 * i
        sessions[i] = ((0.0, leave), (leave + _EARLY_GAP_S, math.inf))
    trace = Trace(sessions)
    trace.save(path)
    return trace


def offline_events(trace: Trace, clients: int, until_s: float) -> int:
    """Intervals that ended (a client going offline) before `until_s`."""
    return sum(
        1
        for i in range(clients)
        for _, off in trace.intervals(i)
        if math.isfinite(off) and off < until_s
    )


class Sampler:
    """Every second: the RSS of each child, of the broker and Redis's used memory."""

    def __init__(self, children: Children, redis_url: str, hosts: list[str]) -> None:
        import redis

        self._children = children
        self._hosts = set(hosts)
        self._redis = redis.Redis.from_url(redis_url)
        self.peak: dict[str, float] = {}
        self.hosts_peak = 0.0
        self.broker_peak = 0.0
        self.redis_peak = 0.0
        # The broker's own view, every `_CTL_EVERY_S` (a rabbitmqctl call costs a second of CPU).
        self.broker_status_peak = 0.0
        self.broker_counts = (0, 0, 0)  # connections, channels, queues at their largest
        self.ctl_problems: list[str] = []
        self._stop = threading.Event()
        self._beam = _beam_pid()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5.0)

    def _run(self) -> None:
        next_ctl = time.monotonic() + 5.0
        while not self._stop.wait(1.0):
            if time.monotonic() >= next_ctl:
                next_ctl = time.monotonic() + _CTL_EVERY_S
                try:
                    memory, *counts = broker_facts()
                except (subprocess.SubprocessError, OSError, ValueError) as exc:
                    self.ctl_problems.append(f"rabbitmqctl: {exc}")
                else:
                    self.broker_status_peak = max(self.broker_status_peak, memory)
                    self.broker_counts = (
                        max(self.broker_counts[0], counts[0]),
                        max(self.broker_counts[1], counts[1]),
                        max(self.broker_counts[2], counts[2]),
                    )
            hosts = 0.0
            for name, process in list(self._children.procs.items()):
                rss = rss_mib(process.pid)
                self.peak[name] = max(self.peak.get(name, 0.0), rss)
                hosts += rss if name in self._hosts else 0.0
            self.hosts_peak = max(self.hosts_peak, hosts)
            if self._beam:
                self.broker_peak = max(self.broker_peak, rss_mib(self._beam))
            try:
                used = float(self._redis.info("memory")["used_memory"])
            except Exception:
                used = 0.0
            self.redis_peak = max(self.redis_peak, used / 2**20)


def rss_mib(pid: int) -> float:
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0.0
    found = re.search(r"VmRSS:\s+(\d+) kB", text)
    return int(found.group(1)) / 1024 if found else 0.0


def _beam_pid() -> int | None:
    """The RabbitMQ node on 5672 (the beam process whose command line names no other port)."""
    done = subprocess.run(["pgrep", "-f", "beam.smp"], capture_output=True, text=True)
    for line in done.stdout.split():
        cmd = Path(f"/proc/{line}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        if "splitmq-cluster" not in cmd:
            return int(line)
    return None


def redis_used_mib(url: str) -> float:
    import redis

    client = redis.Redis.from_url(url)
    try:
        return float(client.info("memory")["used_memory"]) / 2**20
    finally:
        client.close()


def broker_facts() -> tuple[float, int, int, int]:
    """`rabbitmqctl status` total memory (MiB), and the connection, channel, queue counts."""
    ctl = shutil.which("rabbitmqctl") or "/usr/sbin/rabbitmqctl"

    def run(*args: str) -> str:
        return subprocess.run(
            [ctl, *args], capture_output=True, text=True, timeout=120, check=True
        ).stdout

    status = json.loads(run("status", "--formatter", "json"))
    total = float(status.get("memory", {}).get("total", {}).get("rss", 0)) / 2**20
    connections = len(run("list_connections", "-q", "name").split("\n")) - 1
    channels = len(run("list_channels", "-q", "name").split("\n")) - 1
    queues = len(run("list_queues", "-q", "name").split("\n")) - 1
    return total, connections, channels, queues


def clear(settings: Settings, backends: Backends, hosts: list[str]) -> None:
    clear_job(settings, backends, [host_queue_name(settings.job.name, h) for h in hosts])


def run_point(cfg: ScaleConfig) -> ScaleReport:
    job = f"scale-{cfg.algorithm}-{cfg.clients}-{uuid.uuid4().hex[:6]}"
    out = Path(cfg.out_dir or tempfile.mkdtemp(prefix="splitmq-scale-")) / job
    out.mkdir(parents=True, exist_ok=True)
    config = out / "job.toml"
    config.write_text(job_toml(cfg, job, out / "runs"))
    settings = load_settings(config, {})
    backends = Backends(settings.broker, settings.store)
    hosts = [f"h{i}" for i in range(math.ceil(cfg.clients / cfg.per_host))]
    report = ScaleReport(cfg.clients, cfg.algorithm, len(hosts))
    report.load_before = os.getloadavg()[0]
    report.command = " ".join(["python -m benchmarks.scale_clients", *sys.argv[1:]])
    clear(settings, backends, hosts)
    # A round trains 10% of the members for a few steps: the run is joins plus 5 short rounds.
    expected_s = 60.0 + 20.0 * cfg.rounds
    trace = out / "trace.csv"
    churn = churn_trace(cfg, expected_s, trace) if cfg.churn == "trace" else None
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    splits = cfg.algorithm != "fedavg"
    tap = Tap(backends, job, settings.shards) if splits else None
    if tap is not None:
        tap.start()
    children = Children(config, env, out)
    sampler = Sampler(children, cfg.redis_url, hosts)
    run_dir = out / "run"
    t0 = time.monotonic()
    try:
        children.start("aggregator", "aggregator", "--run-dir", str(run_dir), "--no-summary")
        children.start("coordinator", "coordinator")
        for i in range(cfg.workers if splits else 0):
            children.start(f"worker-{i}", "worker", "--id", f"worker-{i}")
        for i, host in enumerate(hosts):
            first = i * cfg.per_host
            count = min(cfg.per_host, cfg.clients - first)
            args = ["--count", str(count), "--first", str(first), "--host", host]
            args += ["--stats-file", str(out / f"{host}.json")]
            if cfg.churn == "trace":
                args += ["--trace", str(trace)]
            children.start(host, "clients", *args)
        for i in range(cfg.standalone):
            partition = str(cfg.clients + i)
            children.start(f"solo-{i}", "client", "--id", f"solo-{i}", "--partition", partition)
        sampler.start()
        aggregator = children.procs["aggregator"]
        while aggregator.poll() is None and time.monotonic() - t0 < cfg.timeout_s:
            time.sleep(0.5)
        report.status = (
            "timeout"
            if aggregator.poll() is None
            else ("finished" if aggregator.returncode == 0 else "aggregator failed")
        )
        deadline = time.monotonic() + 120.0
        while (children.alive("h") or children.alive("solo-")) and time.monotonic() < deadline:
            time.sleep(0.5)
        report.wall_s = time.monotonic() - t0
        children.stop("h", "solo-")
        children.stop("worker-", "coordinator", "aggregator")
        if tap is not None:
            tap.drain()
    finally:
        sampler.stop()
        for name in children.alive(""):
            children.signal(name, 9)
        children.close()
    if churn is not None:
        report.offline_events = offline_events(churn, cfg.clients, report.wall_s)
    report.peak_rss_mib = {k: round(v, 1) for k, v in sampler.peak.items()}
    report.hosts_rss_mib = round(sampler.hosts_peak, 1)
    report.broker_rss_mib = round(sampler.broker_peak, 1)
    report.broker_status_mib = round(sampler.broker_status_peak, 1)
    report.broker_connections, report.broker_channels, report.broker_queues = sampler.broker_counts
    report.problems += sampler.ctl_problems[:3]
    report.redis_used_mib = round(redis_used_mib(cfg.redis_url), 2)
    report.redis_peak_mib = round(sampler.redis_peak, 2)
    _read_hosts(report, out, hosts)
    report.standalone_rounds, report.standalone_finished = _standalone(out, cfg.standalone)
    _read_metrics(report, run_dir)
    if tap is not None:
        soak = SoakReport(job=job, chaos=False, status=report.status)
        sent = set(tap.sent)
        account(soak, settings, backends, sent)
        tap.close()
        report.sent, report.applied = soak.sent, soak.applied
        report.lost, report.duplicates = soak.lost, soak.duplicates
        report.dead_lettered, report.dead_reasons = soak.dead_lettered, soak.dead_reasons
        report.problems += soak.problems
        report.clients_sent_ne_applied = _per_client_mismatches(out, hosts, tap)
    else:
        report.dead_reasons = _dead_letters(backends, job)
        report.dead_lettered = sum(report.dead_reasons.values())
    clear(settings, backends, hosts)
    return report


def _read_hosts(report: ScaleReport, out: Path, hosts: list[str]) -> None:
    joins: list[float] = []
    beats: list[float] = []
    moved = 0
    for host in hosts:
        path = out / f"{host}.json"
        if not path.exists():
            report.problems.append(f"{host} wrote no stats")
            continue
        stats = json.loads(path.read_text())
        report.sessions += stats["sessions"]
        report.joined += sum(1 for c in stats["per_client"].values() if c["joins_sent"] > 0)
        report.uploaded += sum(c["rounds"] for c in stats["per_client"].values())
        joins += stats["join_s"]
        beats += stats["beat_publish_s"]
        total = stats["total"]
        moved += total["batches_sent"] + total["republished"] + total["joins_sent"]
        moved += total["rounds"] + total["rounds_aborted"] + stats["beat_messages"]
        moved += stats["dispatch"]["routed"] + stats["dispatch"]["offline_dropped"]
        if stats["failed"]:
            report.problems.append(f"{host}: {len(stats['failed'])} clients failed")
    for samples, into in ((joins, report.join_ms), (beats, report.heartbeat_ms)):
        if samples:
            into.update({f"p{q}": round(1000 * percentile(samples, q), 1) for q in (50, 90, 99)})
            into["max"] = round(1000 * max(samples), 1)
    report.messages_per_s = round(moved / report.wall_s, 1) if report.wall_s else 0.0
    if report.clients:
        # All in: each host's fixed cost (Python, torch, the dataset) shared by its clients.
        # The marginal cost per client is the slope across points (docs/benchmarks.md).
        report.per_client_kib = round(report.hosts_rss_mib * 1024 / report.clients, 1)


def _read_metrics(report: ScaleReport, run_dir: Path) -> None:
    path = run_dir / "metrics.json"
    if not path.exists():
        report.problems.append("no metrics.json")
        return
    records = json.loads(path.read_text())["records"]
    report.rounds = len(records)
    report.counted = sum(int(r["participants"]) + int(r.get("late_updates", 0)) for r in records)
    if records:
        report.final_accuracy = records[-1]["global_accuracy"]
    if len(records) >= 2:
        span = records[-1]["elapsed_s"] - records[0]["elapsed_s"]
        if span > 0:
            report.rounds_per_min = round(60 * (len(records) - 1) / span, 2)


def _standalone(out: Path, count: int) -> tuple[int, int]:
    """Rounds the standalone clients uploaded, and how many ended with the job, from their last
    log line ("finished after N rounds")."""
    rounds = finished = 0
    for i in range(count):
        for log in out.glob(f"solo-{i}.*.log"):
            found = re.findall(r"(\w+) after (\d+) rounds", log.read_text(errors="replace"))
            if found:
                rounds += int(found[-1][1])
                finished += found[-1][0] == "finished"
    return rounds, finished


def _per_client_mismatches(out: Path, hosts: list[str], tap: Tap) -> int:
    """Clients whose own count of batches sent differs from the tap's (the broker's word)."""
    bad = 0
    for host in hosts:
        path = out / f"{host}.json"
        if path.exists():
            for client, one in json.loads(path.read_text())["per_client"].items():
                bad += one["batches_sent"] != tap.count(client)
    return bad


def _dead_letters(backends: Backends, job: str) -> dict[str, int]:
    from benchmarks.soak import drain_dead

    broker = backends.open_broker("splitmq-scale-dead")
    try:
        reasons, _ = drain_dead(broker, job)
    finally:
        broker.close()
    return dict(reasons.most_common())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, nargs="+", default=[100, 300, 1000])
    parser.add_argument("--algorithms", nargs="+", default=["sfl", "fedavg"])
    parser.add_argument("--fraction", type=float, default=0.1)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--per-host", type=int, default=500)
    parser.add_argument("--churn", choices=["trace", "none"], default="trace")
    parser.add_argument("--standalone", type=int, default=0, help="splitmq client processes too")
    parser.add_argument("--from-json", type=Path, help="only write the docs from an earlier run")
    parser.add_argument("--dataset", default="fashion_mnist")
    parser.add_argument("--out-dir", default="")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--write-docs", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    logging.getLogger("pika").setLevel(logging.WARNING)
    reports: list[ScaleReport] = []
    if args.from_json:
        reports = [ScaleReport(**r) for r in json.loads(args.from_json.read_text())]
        args.algorithms = []
    for algorithm in args.algorithms:
        for clients in args.clients:
            cfg = ScaleConfig(
                clients=clients,
                algorithm=algorithm,
                fraction=args.fraction,
                rounds=args.rounds,
                per_host=args.per_host,
                churn=args.churn,
                standalone=args.standalone,
                dataset=args.dataset,
                out_dir=args.out_dir,
            )
            LOG.info("%s with %d clients", algorithm, clients)
            report = run_point(cfg)
            LOG.info("%s", json.dumps(asdict(report)))
            reports.append(report)
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in reports], indent=2))
    if args.write_docs:
        plot(reports, DOCS_PATH.parent / PLOT.name)
        write_section(SECTION, table(reports))
    ok = all(r.status == "finished" and not r.lost and not r.dead_lettered for r in reports)
    return 0 if ok else 1


def marginal_kib(reports: list[ScaleReport]) -> float | None:
    """RSS per extra client on a host: the least-squares slope of the hosts' RSS against the
    clients, after a fixed cost per host (Python, torch, the dataset)."""
    points = [(r.hosts, r.clients, r.hosts_rss_mib) for r in reports if r.hosts_rss_mib]
    if len({(h, c) for h, c, _ in points}) < 2:
        return None
    import numpy as np

    design = np.array([[h, c] for h, c, _ in points], dtype=float)
    rss = np.array([m for _, _, m in points], dtype=float)
    (_, per_client), *_ = np.linalg.lstsq(design, rss, rcond=None)
    return round(float(per_client) * 1024, 1)


def plot(reports: list[ScaleReport], path: Path) -> None:
    """Hosts' RSS, rounds per minute and join latency against the clients, per algorithm."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(11.0, 3.4), dpi=100)
    FigureCanvasAgg(figure)

    def hosts_rss(r: ScaleReport) -> float:
        return r.hosts_rss_mib

    def rounds_per_min(r: ScaleReport) -> float:
        return r.rounds_per_min

    panels: list[tuple[str, Callable[[ScaleReport], float] | None]] = [
        ("client hosts' RSS (MiB)", hosts_rss),
        ("rounds per minute", rounds_per_min),
        ("join latency p50 / p99 (ms)", None),
    ]
    for k, (title, value) in enumerate(panels, start=1):
        axes = figure.add_subplot(1, 3, k)
        for algorithm, marker in (("sfl", "o"), ("fedavg", "s")):
            rows = sorted((r for r in reports if r.algorithm == algorithm), key=lambda r: r.clients)
            if not rows:
                continue
            xs = [r.clients for r in rows]
            if value is None:
                axes.plot(
                    xs,
                    [r.join_ms.get("p50", 0) for r in rows],
                    marker=marker,
                    label=f"{algorithm} p50",
                )
                axes.plot(
                    xs,
                    [r.join_ms.get("p99", 0) for r in rows],
                    marker=marker,
                    linestyle="--",
                    label=f"{algorithm} p99",
                )
            else:
                axes.plot(xs, [value(r) for r in rows], marker=marker, label=algorithm)
        axes.set_title(title, fontsize=10)
        axes.set_xlabel("live clients")
        axes.grid(True, alpha=0.3)
        axes.legend(fontsize=8)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, format="png")


def table(reports: list[ScaleReport]) -> str:
    commands = sorted({r.command for r in reports})
    loads = ", ".join(f"{r.load_before:.1f}" for r in reports)
    lines = [
        "## Cross-device scale: client hosts (issue 13)",
        "",
        *(f"`{c}`" for c in commands),
        "",
        f"{machine_line()}; load average before each point, in the table's order: {loads} "
        "(the points run back to back: each one's load is mostly its predecessor's). RabbitMQ "
        "and Redis are this machine's single nodes; each point is one job of separate processes "
        "(aggregator, coordinator, two workers for SFL, `splitmq clients` hosts of up to 500).",
        "",
        "| algorithm | clients | hosts | status | rounds/min | hosts' RSS MiB (all-in KiB per "
        "client) | broker MiB | Redis peak MiB | join p50/p99 ms | heartbeat p50/p99 ms | msg/s "
        "| sent | applied | lost | dead letters | offline events |",
        "|---|" + "---|" * 15,
    ]
    for r in reports:
        lines.append(
            f"| {r.algorithm} | {r.clients} | {r.hosts} | {r.status} | {r.rounds_per_min} | "
            f"{r.hosts_rss_mib:.0f} ({r.per_client_kib:.0f}) | {r.broker_status_mib:.0f} | "
            f"{r.redis_peak_mib} | {r.join_ms.get('p50')}/{r.join_ms.get('p99')} | "
            f"{r.heartbeat_ms.get('p50')}/{r.heartbeat_ms.get('p99')} | {r.messages_per_s} | "
            f"{r.sent or r.uploaded} | {r.applied or r.counted} | {r.lost} | "
            f"{r.dead_lettered} | {r.offline_events} |"
        )
    lines += [
        "",
        "sent / applied: SmashedBatches (SFL: on tap queues beside the shard queues, against "
        "the shards' checkpoint audits, per client) or uploaded rounds (FedAvg: the hosts' "
        "counts against the updates the versions counted plus those refused as late). "
        "msg/s: everything the hosts sent and received, over the run's wall time. Offline "
        "events: trace intervals that ended during the run (a client gone mid-round, its "
        "round waiting for its membership to expire, `heartbeat_ttl_s` = 8 s, which is what "
        "holds rounds/min down as churn grows).",
    ]
    for algorithm in sorted({r.algorithm for r in reports}):
        largest = max((r for r in reports if r.algorithm == algorithm), key=lambda r: r.clients)
        peaks = ", ".join(f"{name} {mib:.0f}" for name, mib in sorted(largest.peak_rss_mib.items()))
        lines.append(
            f"- {algorithm}, {largest.clients} clients: peak RSS of every process (MiB): {peaks}; "
            f"the broker's beam process {largest.broker_rss_mib:.0f}; at its largest the "
            f"broker had {largest.broker_connections} connections, {largest.broker_channels} "
            f"channels and {largest.broker_queues} queues."
        )
        slope = marginal_kib([r for r in reports if r.algorithm == algorithm])
        if slope is not None:
            lines.append(
                f"- {algorithm}: RSS per extra client on a host, least squares over its points "
                f"after a fixed cost per host (Python, torch, the dataset): {slope:.0f} KiB."
            )
    lines += [
        "",
        f"![client hosts' RSS, rounds per minute and join latency]({PLOT.name})",
        "",
        "What 10k and 100k clients need, from these costs: docs/capacity.md.",
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
