"""The local cluster of `scripts/cluster.sh` from Python, for the cluster tests and the chaos
benchmark: bring it up and down, read its state, kill and restart its nodes, and time how long
the cluster takes to get over each kill.

The script owns every process and file (ports, data dirs, how a node starts or rejoins, which
role a restarted Redis takes); this module only calls it and asks the running nodes questions,
so the two never disagree about how the cluster is built.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import redis

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "cluster.sh"
RABBITMQ_BIN = Path(os.environ.get("SPLITMQ_RABBITMQ_BIN", "/usr/lib/rabbitmq/bin"))
HOST = "127.0.0.1"
NODES = (1, 2, 3)
REDIS_PORTS = (6390, 6391)
SENTINEL_PORTS = (26390, 26391, 26392)
MASTER_NAME = "splitmq"

T = TypeVar("T")


class ClusterError(RuntimeError):
    """The script failed, or the cluster did not reach a state in time."""


@dataclass(frozen=True)
class Process:
    """One line of `cluster.sh status`: `KIND NAME up|down key=value...`."""

    kind: str
    name: str
    up: bool
    fields: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class ClusterStatus:
    processes: tuple[Process, ...]
    ok: bool

    def of_kind(self, kind: str) -> list[Process]:
        return [p for p in self.processes if p.kind == kind]


@dataclass(frozen=True)
class Kill:
    """A SIGKILL: the process, when the signal went (epoch seconds, `time.time()`), and how long
    the process took to be gone."""

    pid: int
    at: float
    seconds: float


@dataclass(frozen=True)
class Change:
    """Who held a role before and after a kill, and how long the change took: seconds from the
    kill when the wait was given its `since`, else from the start of the wait."""

    old: str
    new: str
    seconds: float


def parse_status(text: str, ok: bool) -> ClusterStatus:
    processes = []
    for line in text.splitlines():
        words = line.split()
        if len(words) < 3 or words[0] == "cluster":
            continue
        fields = dict(w.split("=", 1) for w in words[3:] if "=" in w)
        processes.append(Process(words[0], words[1], words[2] == "up", fields))
    return ClusterStatus(tuple(processes), ok)


def node_name(node: int) -> str:
    return f"splitmq-{node}@localhost"


def available() -> bool:
    """Whether this machine has what the script needs (the Debian RabbitMQ and Redis packages)."""
    return (
        (RABBITMQ_BIN / "rabbitmq-server").exists()
        and shutil.which("redis-server") is not None
        and shutil.which("redis-cli") is not None
    )


def wait_for(what: str, probe: Callable[[], T | None], timeout: float, poll: float = 0.1) -> T:
    """Poll `probe` until it returns something other than None; raise after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = probe()
        if value is not None:
            return value
        if time.monotonic() >= deadline:
            raise ClusterError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(poll)


class LocalCluster:
    """Three RabbitMQ nodes and a Redis primary, replica and three Sentinels on this machine."""

    master_name = MASTER_NAME

    def __init__(self, directory: str | None = None, script: Path = SCRIPT) -> None:
        self._script = script
        self._env = dict(os.environ)
        if directory is not None:
            self._env["SPLITMQ_CLUSTER_DIR"] = directory
        self.last_log = ""

    # ---------------------------------------------------------------- addresses
    @property
    def amqp_urls(self) -> list[str]:
        return [f"amqp://guest:guest@{HOST}:{5700 + n}/%2F" for n in NODES]

    def amqp_url(self, node: int) -> str:
        return self.amqp_urls[node - 1]

    @property
    def sentinels(self) -> list[str]:
        return [f"{HOST}:{p}" for p in SENTINEL_PORTS]

    @property
    def redis_url(self) -> str:
        """The `[store] redis_url` to pair with `sentinels`: it gives the db, not the host."""
        return f"redis://{HOST}:{REDIS_PORTS[0]}/0"

    # ---------------------------------------------------------------- whole cluster
    def _call(self, *args: str, timeout: float) -> subprocess.CompletedProcess[str]:
        try:
            return subprocess.run(
                ["bash", str(self._script), *args],
                env=self._env,
                capture_output=True,
                text=True,
                timeout=timeout,
                check=False,
            )
        except subprocess.TimeoutExpired as e:
            raise ClusterError(f"cluster.sh {' '.join(args)}: no answer in {timeout:.0f} s") from e

    def _run(self, *args: str, timeout: float = 600.0) -> str:
        done = self._call(*args, timeout=timeout)
        self.last_log = done.stderr  # what the script said it did (e.g. which nodes it started)
        if done.returncode != 0:
            raise ClusterError(
                f"cluster.sh {' '.join(args)} failed ({done.returncode}): {done.stderr.strip()}"
            )
        return done.stdout

    def up(self) -> float:
        """Bring the cluster up (or leave it as it is); seconds it took."""
        return self._timed(lambda: self._run("up"))

    def down(self) -> float:
        return self._timed(lambda: self._run("down"))

    def status(self) -> ClusterStatus:
        done = self._call("status", timeout=60)
        return parse_status(done.stdout, done.returncode == 0)

    def is_up(self) -> bool:
        return self.status().ok

    # ---------------------------------------------------------------- RabbitMQ
    def rabbit_log_tail(self, node: int, lines: int = 30) -> str:
        """The end of node `node`'s logs (what it said before it stopped), for failures."""
        folder = Path(self._env.get("SPLITMQ_CLUSTER_DIR", "/tmp/splitmq-cluster"))
        tails = []
        for log in sorted((folder / f"rabbit-{node}" / "log").glob("*.log")):
            text = log.read_text(errors="replace").splitlines()[-lines:]
            tails.append(f"--- {log}\n" + "\n".join(text))
        return "\n".join(tails)

    def sentinel_events(self) -> str:
        """What each Sentinel logged about masters and failovers (`+switch-master`, `+sdown`,
        `+convert-to-slave`, ...), for failures: a second failover explains a surprising role."""
        folder = Path(self._env.get("SPLITMQ_CLUSTER_DIR", "/tmp/splitmq-cluster"))
        marks = ("switch-master", "sdown", "odown", "convert-to-slave", "failover", "slave ")
        parts = []
        for log in sorted(folder.glob("sentinel-*/sentinel.log")):
            lines = log.read_text(errors="replace").splitlines()
            parts.append(f"--- {log}\n" + "\n".join(x for x in lines if any(m in x for m in marks)))
        return "\n".join(parts)

    def rabbit_pid(self, node: int) -> int | None:
        out = self._call("pid", "rabbit", str(node), timeout=30).stdout.strip()
        return int(out) if out.isdigit() else None

    def kill_rabbit(self, node: int) -> Kill:
        """SIGKILL the node's beam."""
        return self._kill("kill-node", str(node), f"RabbitMQ node {node}")

    def start_rabbit(self, node: int) -> float:
        """Start a node (it rejoins the cluster); seconds until its app runs in the cluster."""
        return self._timed(lambda: self._run("start-node", str(node)))

    def rabbitmqctl(self, *args: str) -> str:
        """rabbitmqctl on the first live node."""
        return self._run("ctl", *args, timeout=60)

    def quorum_queues(self, vhost: str = "/") -> dict[str, Mapping[str, object]]:
        out = self.rabbitmqctl(
            "list_queues",
            "-p",
            vhost,
            "name",
            "type",
            "leader",
            "members",
            "online",
            "--formatter",
            "json",
        )
        rows: Sequence[Mapping[str, object]] = json.loads(out or "[]")
        return {str(r["name"]): r for r in rows if r.get("type") == "quorum"}

    def quorum_leader(self, queue: str, vhost: str = "/") -> str:
        """The node that leads a quorum queue, e.g. "splitmq-1@localhost"."""
        row = self.quorum_queues(vhost).get(queue)
        if row is None:
            raise ClusterError(f"no quorum queue {queue!r} in vhost {vhost!r}")
        return str(row["leader"])

    def wait_for_new_leader(
        self,
        queue: str,
        old: str,
        timeout: float = 30.0,
        vhost: str = "/",
        since: float | None = None,
    ) -> Change:
        """Wait until an online node other than `old` leads `queue`."""

        def probe() -> str | None:
            try:
                row = self.quorum_queues(vhost).get(queue)
            except ClusterError:
                return None  # the CLI picked a node as it went away: ask again
            if row is None:
                return None
            leader, online = str(row.get("leader", "")), row.get("online", [])
            ok = leader not in ("", old) and isinstance(online, list) and leader in online
            return leader if ok else None

        start = time.time() if since is None else since
        new = wait_for(f"a new leader of {queue}", probe, timeout, poll=0.2)
        return Change(old, new, time.time() - start)

    # ---------------------------------------------------------------- Redis
    def redis_primary(self) -> str:
        """host:port of the primary, as the first Sentinel that answers sees it."""
        primary = _ask_sentinels()
        if primary is None:
            raise ClusterError("no Sentinel names a primary")
        return primary

    def kill_redis(self, port: int) -> Kill:
        return self._kill("kill-redis", str(port), f"Redis {port}")

    def kill_redis_primary(self) -> tuple[str, Kill]:
        """SIGKILL the primary; its address and the kill."""
        old = self.redis_primary()
        return old, self.kill_redis(int(old.rsplit(":", 1)[1]))

    def _kill(self, command: str, which: str, what: str) -> Kill:
        out = self._run(command, which)
        words = out.split()  # "killed PID at EPOCH"
        if len(words) != 4 or words[0] != "killed":
            raise ClusterError(f"{what} was not running")
        at = float(words[3])
        return Kill(int(words[1]), at, time.time() - at)

    def wait_for_new_primary(
        self, old: str, timeout: float = 30.0, since: float | None = None
    ) -> Change:
        """Wait until Sentinel names a primary other than `old` and that server says it is one."""

        def probe() -> str | None:
            new = _ask_sentinels()
            if new is None or new == old:
                return None
            host, port = new.rsplit(":", 1)
            return new if _role(host, int(port)) == "master" else None

        start = time.time() if since is None else since
        new = wait_for("Sentinel to promote a new primary", probe, timeout)
        return Change(old, new, time.time() - start)

    def restart_redis(self, port: int) -> float:
        """Start a killed server again, as a replica of the current primary when it is not the
        primary; seconds until it answered and, as a replica, was in sync."""
        return self._timed(lambda: self._run("start-redis", str(port)))

    @staticmethod
    def _timed(action: Callable[[], object]) -> float:
        start = time.monotonic()
        action()
        return time.monotonic() - start


def _ask_sentinels() -> str | None:
    for port in SENTINEL_PORTS:
        client = redis.Redis(host=HOST, port=port, socket_timeout=0.5, decode_responses=True)
        try:
            addr = client.sentinel_get_master_addr_by_name(MASTER_NAME, return_responses=True)
        except redis.RedisError:
            continue  # that Sentinel is down: ask the next
        finally:
            client.close()
        if isinstance(addr, tuple | list) and len(addr) == 2:
            parts = [a.decode() if isinstance(a, bytes) else str(a) for a in addr]
            return ":".join(parts)
    return None


def _role(host: str, port: int) -> str | None:
    client = redis.Redis(host=host, port=port, socket_timeout=0.5)
    try:
        info = client.info("replication")
        return str(info.get("role"))
    except redis.RedisError:
        return None
    finally:
        client.close()
