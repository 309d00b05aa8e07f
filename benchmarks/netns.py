"""Linux network namespaces as stand-in hosts: each host a namespace with `lo` up, hosts joined
by veth pairs with their own /24, commands run inside one with `ip netns exec`, a link cut and
restored with `ip link set ... down|up`. Needs root and iproute2.

    with Hosts("servers", "workers") as hosts:
        link = hosts.link("servers", "workers", subnet=1)   # 10.77.1.1 <-> 10.77.1.2
        proc = hosts.spawn("servers", ["redis-server", ...], log=path)
        hosts.set_link(link, up=False)

Cleanup is guaranteed three ways: `close()` (also on `__exit__`, however the block ends) kills
every process inside each namespace (`ip netns pids`: also daemons that detached, like the
epmd an Erlang node starts) and deletes the namespaces, which destroys their veths; namespace
names carry the creating process's pid, so a later `Hosts` also removes what a SIGKILLed run
left behind (`sweep_stale`).
"""

from __future__ import annotations

import fcntl
import os
import re
import shutil
import signal
import subprocess
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import IO

NS_PREFIX = "splitmq-"
_NS_NAME = re.compile(rf"^{NS_PREFIX}(\d+)-[0-9a-f]+-")
_NET = "10.77"
# The links to the root namespace share one address space with every other run on the machine:
# their /24 is picked under this lock from the ones no root route uses yet.
_ROOT_SUBNETS = range(100, 255)
_LOCK = Path("/run/lock/splitmq-netns.lock")


class NetnsUnavailable(RuntimeError):
    """Not root, or no `ip netns` here."""


def unavailable_reason() -> str | None:
    """Why namespaces cannot be made here (None: they can)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "iproute2's `ip` is not installed"
    probe = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False)
    if probe.returncode != 0:
        return f"`ip netns` does not work here: {probe.stderr.strip()}"
    return None


def _ip(*args: str, check: bool = True) -> str:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, check=False)
    if check and done.returncode != 0:
        raise NetnsUnavailable(f"ip {' '.join(args)}: {done.stderr.strip()}")
    return done.stdout


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def destroy_namespace(name: str) -> None:
    """SIGKILL every process in namespace `name`, then delete it (its veths go with it)."""
    for _ in range(50):
        pids = [int(p) for p in _ip("netns", "pids", name, check=False).split()]
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.1)  # a killed process leaves the namespace when the kernel reaps it
    _ip("netns", "delete", name, check=False)


def sweep_stale() -> list[str]:
    """Delete the namespaces of earlier runs whose process is gone; their names."""
    swept = []
    for line in _ip("netns", "list", check=False).splitlines():
        name = line.split()[0] if line.split() else ""
        found = _NS_NAME.match(name)
        if found and not _pid_alive(int(found.group(1))):
            destroy_namespace(name)
            swept.append(name)
    return swept


@dataclass(frozen=True)
class Link:
    """A veth pair between hosts `a` and `b` ("" for the root namespace): `end_a` in `a` with
    address `ip_a`, `end_b` in `b` with `ip_b`, on one /24."""

    a: str
    b: str
    end_a: str
    end_b: str
    ip_a: str
    ip_b: str


class Hosts:
    """Namespaces named `splitmq-<pid>-<tag>-<host>`, one per host, and the links between them."""

    def __init__(self, *names: str, tag: str | None = None) -> None:
        reason = unavailable_reason()
        if reason is not None:
            raise NetnsUnavailable(reason)
        sweep_stale()
        self.tag = tag or uuid.uuid4().hex[:6]
        self._ns = {h: f"{NS_PREFIX}{os.getpid()}-{self.tag}-{h}" for h in names}
        self.links: list[Link] = []
        self._procs: list[subprocess.Popen[bytes]] = []
        self._logs: list[IO[bytes]] = []
        self._closed = False
        try:
            for ns in self._ns.values():
                _ip("netns", "add", ns)
                _ip("-n", ns, "link", "set", "lo", "up")
        except BaseException:
            self.close()
            raise

    def namespace(self, host: str) -> str:
        return self._ns[host]

    def prefix(self, host: str) -> list[str]:
        """What goes before a command line to run it on `host`."""
        return ["ip", "netns", "exec", self._ns[host]]

    def link(self, a: str, b: str, subnet: int | None = None) -> Link:
        """Join `a` and `b` (b = "" for the root namespace) by a veth pair on 10.77.<subnet>.0/24,
        a at .1 and b at .2, both ends up. A link to the root namespace picks its own subnet."""
        n = len(self.links)
        end_a, end_b = f"smq{self.tag}{n}a", f"smq{self.tag}{n}b"
        with _root_lock() if b == "" else nullcontext():
            if subnet is None:
                subnet = _free_root_subnet()
            ip_a, ip_b = f"{_NET}.{subnet}.1", f"{_NET}.{subnet}.2"
            peer = ["peer", "name", end_b, *(["netns", self._ns[b]] if b else [])]
            _ip("link", "add", end_a, "netns", self._ns[a], "type", "veth", *peer)
            link = Link(a, b, end_a, end_b, ip_a, ip_b)
            self.links.append(link)
            for host, end, ip in ((a, end_a, ip_a), (b, end_b, ip_b)):
                _ip(*self._in(host), "addr", "add", f"{ip}/24", "dev", end)
                _ip(*self._in(host), "link", "set", end, "up")
        return link

    def set_link(self, link: Link, *, up: bool) -> None:
        """Bring `link`'s end in host `a` down or up: both ends lose (or regain) carrier, and
        host a also loses its route to the subnet while it is down."""
        _ip(*self._in(link.a), "link", "set", link.end_a, "up" if up else "down")

    def spawn(
        self,
        host: str,
        argv: Sequence[str],
        *,
        log: Path,
        env: Mapping[str, str] | None = None,
        cwd: Path | None = None,
    ) -> subprocess.Popen[bytes]:
        """Start `argv` on `host`, output to `log`; killed at close if still running."""
        out = log.open("wb")
        self._logs.append(out)
        process = subprocess.Popen(
            [*self.prefix(host), *argv],
            env=dict(env) if env is not None else None,
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self._procs.append(process)
        return process

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for ns in self._ns.values():
            destroy_namespace(ns)
        for link in self.links:
            if link.b == "":
                _ip("link", "delete", link.end_b, check=False)  # gone with its peer already
        for process in self._procs:
            process.wait()
        for out in self._logs:
            out.close()

    def __enter__(self) -> Hosts:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    def _in(self, host: str) -> list[str]:
        return ["-n", self._ns[host]] if host else []


@contextmanager
def _root_lock() -> Iterator[None]:
    _LOCK.parent.mkdir(parents=True, exist_ok=True)
    with _LOCK.open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _free_root_subnet() -> int:
    routes = _ip("-4", "route", "show", "table", "all")
    for subnet in _ROOT_SUBNETS:
        if f"{_NET}.{subnet}." not in routes:
            return subnet
    raise NetnsUnavailable(f"no free {_NET}.x.0/24 left for a link to the root namespace")
