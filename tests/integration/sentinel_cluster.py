"""A Redis primary with replicas and three Sentinels, started by a test on its own ports.

redis-server starts in milliseconds, so each test that kills nodes gets a fresh cluster; the
store contract suite shares one for the session. Ports 6490-6499 (data) and 26490-26499
(Sentinels) are this module's; scripts/cluster.sh's 6390/26390 ports are never used. Every
process is SIGKILLed at teardown. Under CI=true a missing redis-server is a failure.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
import redis

MASTER = "splitmq"
HOST = "127.0.0.1"
# Sentinel declares a primary down after this long without a reply: short, for quick tests.
DOWN_AFTER_MS = 1000


def require_redis_server() -> None:
    if shutil.which("redis-server") is not None:
        return
    message = "redis-server is not installed"
    if os.environ.get("CI", "").lower() in {"1", "true", "yes"}:
        pytest.fail(f"{message} (CI=true: a missing service is a failure, not a skip)")
    pytest.skip(f"{message}; install it (apt-get install redis-server) or set CI=true")


def wait_for(what: str, check: Callable[[], bool], timeout_s: float = 30.0) -> float:
    """Poll `check` until it is true; the seconds it took. Fails the test after `timeout_s`."""
    start = time.monotonic()
    while True:
        try:
            if check():
                return time.monotonic() - start
        except redis.RedisError:
            pass
        if time.monotonic() - start > timeout_s:
            pytest.fail(f"{what}: not within {timeout_s:g} s")
        time.sleep(0.02)


class SentinelCluster:
    """`data_ports[0]` starts as the primary, the others as its replicas."""

    def __init__(self, directory: Path, data_ports: Sequence[int], sentinel_ports: Sequence[int]):
        self.dir = directory
        self.data_ports = list(data_ports)
        self.sentinel_ports = list(sentinel_ports)
        self.processes: dict[int, subprocess.Popen[bytes]] = {}

    @property
    def sentinels(self) -> list[str]:
        return [f"{HOST}:{port}" for port in self.sentinel_ports]

    @property
    def url(self) -> str:
        """The URL the store gets: only its db counts with sentinels set."""
        return f"redis://{HOST}:{self.data_ports[0]}/0"

    def client(self, port: int) -> redis.Redis:
        return redis.Redis(HOST, port, socket_timeout=2.0, socket_connect_timeout=1.0)

    def start(self) -> None:
        primary = self.data_ports[0]
        for port in self.data_ports:
            self.start_node(port, None if port == primary else primary)
        for port in self.data_ports[1:]:
            self.wait_replica_linked(port)
        for port in self.sentinel_ports:
            self._start_sentinel(port, primary)
        self.wait_sentinels_agree(primary, len(self.data_ports) - 1)

    def start_node(self, port: int, replica_of: int | None) -> None:
        node_dir = self.dir / f"redis-{port}"
        node_dir.mkdir(exist_ok=True)
        argv = ["redis-server", "--port", str(port), "--bind", HOST, "--save", ""]
        argv += ["--appendonly", "yes", "--appendfsync", "always", "--dir", str(node_dir)]
        # Redis 7 holds a diskless full sync back 5 s for more replicas to join it.
        argv += ["--repl-diskless-sync-delay", "0"]
        if replica_of is not None:
            argv += ["--replicaof", HOST, str(replica_of)]
        self._spawn(port, argv, node_dir)
        wait_for(f"redis-server on {port} answers", lambda: bool(self.client(port).ping()))

    def _start_sentinel(self, port: int, primary: int) -> None:
        node_dir = self.dir / f"sentinel-{port}"
        node_dir.mkdir(exist_ok=True)
        conf = node_dir / "sentinel.conf"
        conf.write_text(
            f"port {port}\nbind {HOST}\ndir {node_dir}\n"
            f"sentinel monitor {MASTER} {HOST} {primary} 2\n"
            f"sentinel down-after-milliseconds {MASTER} {DOWN_AFTER_MS}\n"
            f"sentinel failover-timeout {MASTER} 10000\n"
            f"sentinel parallel-syncs {MASTER} 2\n"
        )
        self._spawn(port, ["redis-server", str(conf), "--sentinel"], node_dir)
        wait_for(f"sentinel on {port} answers", lambda: bool(self.client(port).ping()))

    def _spawn(self, port: int, argv: list[str], node_dir: Path) -> None:
        with (node_dir / "log").open("ab") as log:
            self.processes[port] = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)

    def wait_replica_linked(self, port: int) -> None:
        def linked() -> bool:
            info = self.client(port).info("replication")
            return info.get("master_link_status") == "up"

        wait_for(f"replica {port} linked to its primary", linked)

    def wait_sentinels_agree(self, primary: int, replicas: int, timeout_s: float = 30.0) -> float:
        """Every sentinel names `primary`, knows the others and `replicas` replicas."""

        def agreed() -> bool:
            for port in self.sentinel_ports:
                state = self.client(port).sentinel_master(MASTER)
                if int(state["port"]) != primary or "s_down" in state["flags"]:
                    return False
                if state["num-other-sentinels"] != len(self.sentinel_ports) - 1:
                    return False
                if state["num-slaves"] < replicas:
                    return False
            return True

        return wait_for(f"sentinels agree on primary {primary}", agreed, timeout_s)

    def primary_port(self) -> int:
        """The port the first sentinel names as the primary."""
        addr = self.client(self.sentinel_ports[0]).sentinel_get_master_addr_by_name(MASTER)
        return int(addr[1])

    def sigkill(self, port: int) -> None:
        process = self.processes.pop(port)
        process.send_signal(signal.SIGKILL)
        process.wait(10)

    def stop(self) -> None:
        for port in list(self.processes):
            self.sigkill(port)
