"""Roles on separate hosts (issue 12 item 4): the soak's sharded SFL job with the broker and
store, the workers and the clients in three network namespaces joined by veth links, so every
message crosses a network interface, and a link cut for a few seconds mid-run.

    python -m benchmarks.netns_soak --cut clients --cut workers --down 5

Hosts (benchmarks/netns.py), each a namespace:

- `servers`: a RabbitMQ node and a Redis of this run's own (data under the run's directory),
  on the standard ports inside the namespace, where nothing else listens;
- `workers`: the workers, and the coordinator and the aggregator: the operator's side of split
  learning, where the server-side model lives; the broker and store are infrastructure they
  reach over the network like every other role. Nothing then runs beside the broker, and a cut
  of this link takes the whole service side away from it at once (membership, rounds, shards);
- `clients`: the clients, the edge.

`workers` and `clients` each have a veth link to `servers` (10.77.1.0/24, 10.77.2.0/24), and
`servers` one to the root namespace (a /24 picked free), where this driver runs its tap and
its counting (benchmarks/soak.py): that link is never cut, so what is counted is never what
was disturbed. Cut i takes place when the tap has seen the batches of i + 0.5 rounds (mid-way
through round i, whatever the machine's speed): the role host's end of the link goes down for
`down_s` and comes back. The stall of a cut is the longest the tap saw no new batch across it.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from itertools import pairwise
from pathlib import Path

from benchmarks.netns import Hosts, Link
from benchmarks.soak import (
    Children,
    RoleSite,
    SoakConfig,
    SoakReport,
    Tap,
    add_job_arguments,
    job_shape,
    run_once,
    table,
)
from broker.store import WeightStore

LOG = logging.getLogger("splitmq.netns")

AMQP_PORT = 5672
REDIS_PORT = 6379
# Where each role runs; the driver (root namespace) reaches the servers over their own link.
ROLE_HOSTS = {
    "aggregator": "workers",
    "coordinator": "workers",
    "worker": "workers",
    "client": "clients",
}
LINK_SUBNETS = {"workers": 1, "clients": 2}
_POLL_S = 0.02
_GONE = re.compile(r"WorkerStats\(.*\bgone_replies=(\d+)")


# A CI-sized job on the shipped sample (46 batches a client at 4 clients: every client runs
# all `steps` in each round, which the cuts' timing counts on).
SMALL_JOB = SoakConfig(workers=2, clients=4, shards=2, rounds=2, steps=10, seed=3, chaos=False)


@dataclass(frozen=True)
class NetnsConfig:
    soak: SoakConfig = SMALL_JOB
    cuts: tuple[str, ...] = ("clients",)  # cut i mid-way through round i
    down_s: float = 5.0


@dataclass
class CutResult:
    link: str
    at_batches: int  # distinct batches the tap had seen when the link went down
    down_s: float = 0.0  # how long it was down
    stall_s: float = 0.0  # longest span without a new batch across the cut
    resumed_after_up_s: float = 0.0  # from the link's return to the next batch


@dataclass
class NetnsReport:
    soak: SoakReport
    cuts: list[CutResult] = field(default_factory=list)
    longest_other_gap_s: float = 0.0  # the longest span without a batch away from the cuts
    servers_start_s: float = 0.0
    # Copies the workers took for batches applied already and answered "gone" (their
    # WorkerStats at exit): a batch lost that way was never applied, only taken for a copy.
    gone_replies: int = 0
    problems: list[str] = field(default_factory=list)


# --- the servers --------------------------------------------------------------------------------


def start_servers(hosts: Hosts, host: str, workdir: Path, address: str, timeout_s: float) -> float:
    """A RabbitMQ node and a Redis on `host`, data under `workdir`; waits until both answer at
    `address` (as the driver reaches them). Returns the seconds that took."""
    t0 = time.monotonic()
    rabbit = workdir / "rabbitmq"
    (rabbit / "home").mkdir(parents=True, exist_ok=True)
    # The node must ignore the machine's /etc/rabbitmq (node name, listener on 127.0.0.1), and
    # let guest in from other hosts (by default only from loopback).
    (rabbit / "rabbitmq.conf").write_text(
        f"listeners.tcp.default = {AMQP_PORT}\nloopback_users = none\n"
    )
    (rabbit / "rabbitmq-env.conf").write_text("")
    env = {
        **os.environ,
        "HOME": str(rabbit / "home"),  # its Erlang cookie
        "RABBITMQ_CONF_ENV_FILE": str(rabbit / "rabbitmq-env.conf"),
        "RABBITMQ_CONFIG_FILE": str(rabbit / "rabbitmq.conf"),
        "RABBITMQ_NODENAME": f"splitmq-netns-{hosts.tag}@localhost",
        "RABBITMQ_MNESIA_BASE": str(rabbit / "mnesia"),
        "RABBITMQ_LOG_BASE": str(rabbit / "log"),
        "RABBITMQ_ENABLED_PLUGINS_FILE": str(rabbit / "enabled_plugins"),
    }
    server = shutil.which("rabbitmq-server", path="/usr/lib/rabbitmq/bin") or "rabbitmq-server"
    hosts.spawn(host, [server], env=env, log=workdir / "rabbitmq.log", cwd=rabbit)
    redis = workdir / "redis"
    redis.mkdir(exist_ok=True)
    argv = ["redis-server", "--port", str(REDIS_PORT), "--bind", "0.0.0.0"]
    argv += ["--protected-mode", "no", "--save", "", "--appendonly", "no", "--dir", str(redis)]
    hosts.spawn(host, argv, log=workdir / "redis.log")
    deadline = time.monotonic() + timeout_s
    for what, ready in (("Redis", _redis_ready), ("RabbitMQ", _amqp_ready)):
        while not ready(address):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what} on {host} did not answer within {timeout_s:.0f} s")
            time.sleep(0.2)
    return time.monotonic() - t0


def _exchange(address: str, port: int, send: bytes) -> bytes:
    try:
        with socket.create_connection((address, port), 1.0) as conn:
            conn.settimeout(2.0)
            conn.sendall(send)
            return conn.recv(16)
    except OSError:
        return b""


def _amqp_ready(address: str) -> bool:
    # A node accepts connections only once booted; its answer to the protocol header is a
    # Connection.Start method frame (type 1).
    return _exchange(address, AMQP_PORT, b"AMQP\x00\x00\x09\x01")[:1] == b"\x01"


def _redis_ready(address: str) -> bool:
    return _exchange(address, REDIS_PORT, b"PING\r\n").startswith(b"+PONG")


# --- the cuts -----------------------------------------------------------------------------------


class LinkCutter:
    """Cuts the planned links at points of the job (a soak.ChaosRunner, from `chaos`); the
    stalls come from the tap's arrival times."""

    def __init__(
        self, hosts: Hosts, links: dict[str, Link], plan: list[tuple[str, int]], down_s: float
    ) -> None:
        self._hosts = hosts
        self._links = links
        self._plan = list(plan)  # (link, distinct batches seen) in order
        self._down_s = down_s
        self._tap: Tap | None = None
        self.windows: list[tuple[str, int, float, float]] = []  # link, batches, down, up
        self.problems: list[str] = []

    def chaos(
        self, children: Children, report: SoakReport, tap: Tap, store: WeightStore
    ) -> LinkCutter:
        """soak.MakeChaos: this cutter, watching `tap`."""
        self._tap = tap
        return self

    def run(self, stop: threading.Event, started: Callable[[], float | None]) -> None:
        assert self._tap is not None, "chaos() first"
        down: tuple[str, int, float] | None = None
        try:
            while not stop.wait(_POLL_S):
                started()
                now, seen = time.monotonic(), len(self._tap.sent)
                if down is not None and now - down[2] >= self._down_s:
                    self._hosts.set_link(self._links[down[0]], up=True)
                    LOG.info("link %s up after %.1f s", down[0], now - down[2])
                    self.windows.append((*down, now))
                    down = None
                elif down is None and self._plan and seen >= self._plan[0][1]:
                    name, _ = self._plan.pop(0)
                    LOG.info("link %s down at %d batches", name, seen)
                    self._hosts.set_link(self._links[name], up=False)
                    down = (name, seen, time.monotonic())
        finally:
            if down is not None:
                self._hosts.set_link(self._links[down[0]], up=True)
                self.problems.append(f"the job ended while link {down[0]} was down")
            if self._plan:
                self.problems.append(f"cuts not done (the job ended first): {self._plan}")

    def results(self) -> tuple[list[CutResult], float]:
        """Each cut's stall, and the longest gap between batches away from every cut."""
        arrivals = self._tap.arrivals if self._tap is not None else []
        gaps = list(pairwise(arrivals))
        cuts, near = [], []
        for link, at, down, up in self.windows:
            across = [(a, b) for a, b in gaps if b > down and a < up] or [(down, up)]
            start, end = across[0][0], across[-1][1]
            stall = max(b - a for a, b in across)
            resumed = next((b for _, b in across if b >= up), end)
            cuts.append(CutResult(link, at, up - down, stall, max(0.0, resumed - up)))
            near.append((start, end))
        other = [b - a for a, b in gaps if not any(a < e and b > s for s, e in near)]
        return cuts, max(other, default=0.0)


# --- one run ------------------------------------------------------------------------------------


class ThreeHosts:
    """The three hosts, their links and the servers, for one job after another; a context
    manager (namespaces, links and every process in them gone on exit, however it ends)."""

    def __init__(self, workdir: Path, server_start_timeout_s: float = 120.0) -> None:
        self.workdir = workdir
        self.hosts = Hosts("servers", "workers", "clients")
        try:
            ctl = self.hosts.link("servers", "")
            self.links = {h: self.hosts.link(h, "servers", n) for h, n in LINK_SUBNETS.items()}
            self.driver_urls = _urls(ctl.ip_a)
            self.servers_start_s = start_servers(
                self.hosts, "servers", workdir, ctl.ip_a, server_start_timeout_s
            )
        except BaseException:
            self.hosts.close()
            raise
        self._sites = {
            role: RoleSite(tuple(self.hosts.prefix(host)), _urls(self.links[host].ip_b))
            for role, host in ROLE_HOSTS.items()
        }

    def site(self, role: str) -> RoleSite:
        """soak.Placement: the role's host, and the servers' address as seen from there."""
        return self._sites[role]

    def __enter__(self) -> ThreeHosts:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.hosts.close()


def run_job(where: ThreeHosts, cfg: NetnsConfig) -> NetnsReport:
    """One job on `where` with cfg's cuts (each link is up again on return)."""
    per_round = cfg.soak.clients * cfg.soak.steps
    plan = [(name, int((i + 0.5) * per_round)) for i, name in enumerate(cfg.cuts)]
    cutter = LinkCutter(where.hosts, where.links, plan, cfg.down_s)
    soak = replace(
        cfg.soak,
        amqp_url=where.driver_urls["SPLITMQ_AMQP_URL"],
        redis_url=where.driver_urls["SPLITMQ_REDIS_URL"],
        out_dir=str(where.workdir),
    )
    report = run_once(soak, cutter.chaos, placement=where.site)
    cuts, other = cutter.results()
    gone = gone_replies(where.workdir / report.job)
    return NetnsReport(report, cuts, other, where.servers_start_s, gone, cutter.problems)


def gone_replies(log_dir: Path) -> int:
    """The workers' `gone_replies`, from the WorkerStats each logs when it stops."""
    found = (_GONE.findall(log.read_text(errors="replace")) for log in log_dir.glob("worker-*.log"))
    return sum(int(n[-1]) for n in found if n)


def _urls(address: str) -> dict[str, str]:
    return {
        "SPLITMQ_AMQP_URL": f"amqp://guest:guest@{address}:{AMQP_PORT}/%2F",
        "SPLITMQ_REDIS_URL": f"redis://{address}:{REDIS_PORT}/0",
    }


def cut_table(report: NetnsReport) -> str:
    rows = [f"servers up in {report.servers_start_s:.1f} s"]
    rows += [
        f"cut {c.link}: down {c.down_s:.1f} s at {c.at_batches} batches, stall {c.stall_s:.1f} s,"
        f" batches again {c.resumed_after_up_s:.1f} s after the link returned"
        for c in report.cuts
    ]
    other = report.longest_other_gap_s
    rows.append(f"copies answered 'gone' by the workers: {report.gone_replies}")
    rows.append(f"longest gap between batches away from the cuts: {other:.1f} s")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_job_arguments(
        parser,
        SoakConfig(
            workers=2, clients=4, shards=2, rounds=SMALL_JOB.rounds, steps=SMALL_JOB.steps, seed=3
        ),
    )
    parser.add_argument("--cut", action="append", choices=sorted(LINK_SUBNETS), default=None)
    parser.add_argument("--down", type=float, default=5.0)
    parser.add_argument("--out", default="")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("pika").setLevel(logging.WARNING)
    soak = SoakConfig(
        **job_shape(args),
        chaos=False,
        timeout_s=600.0,
    )
    cfg = NetnsConfig(soak, tuple(args.cut or ("clients",)), args.down)
    # A SIGTERM (a timeout, say) unwinds like Ctrl-C, so the hosts are taken down on the way.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    load = os.getloadavg()
    with ThreeHosts(Path(args.out or tempfile.mkdtemp(prefix="splitmq-netns-"))) as where:
        report = run_job(where, cfg)
    LOG.info("report: %s", asdict(report))
    print(f"load average before {load[0]:.1f}, after {os.getloadavg()[0]:.1f}")
    print(table(report.soak, None))
    print(cut_table(report))
    for problem in [*report.soak.problems, *report.problems]:
        print("problem:", problem)
    s = report.soak
    ok = s.status == "finished" and s.lost == s.duplicates == 0 and not report.problems
    return 0 if ok and len(report.cuts) == len(cfg.cuts) else 1


if __name__ == "__main__":
    sys.exit(main())
