"""Health records: a role process says "alive"; `splitmq check ROLE` reads it. A role's is the
store member `health:<role>:<instance>`, refreshed every `REFRESH_S` with a TTL of `TTL_S`; an
edge client's (it holds no Redis credentials) a file on its own machine (`FileHealthBeat`).
What each check means and the keys' timing: docs/deployment.md, "Health checks".
"""

from __future__ import annotations

import json
import logging
import os
import socket
import tempfile
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Self

from broker.errors import SplitMQError
from broker.keys import HEALTH_MEMBER_PREFIX
from broker.store import Member, MemberStore

REFRESH_S = 5.0
TTL_S = 15.0


def health_member(role: str, instance: str) -> str:
    return f"{HEALTH_MEMBER_PREFIX}{role}:{instance}"


@dataclass(frozen=True)
class Verdict:
    """What `splitmq check` prints (`reason`, one line) and whether it exits 0 (`ok`)."""

    ok: bool
    reason: str


def assess(
    members: Mapping[str, Member],
    role: str,
    *,
    job: str,
    host: str | None = None,
    instance: str | None = None,
    now: float | None = None,
) -> Verdict:
    """Is a `role` process alive: the one named `instance`, else one on `host`, else any."""
    prefix = health_member(role, "")
    found = {mid[len(prefix) :]: m for mid, m in members.items() if mid.startswith(prefix)}
    if instance is not None:
        mine = {i: m for i, m in found.items() if i == instance}
        where = f"named {instance}"
    elif host is not None:
        mine = {i: m for i, m in found.items() if m.info.get("host") == host}
        where = f"on host {host}"
    else:
        mine, where = found, "anywhere"
    if not mine:
        note = f" ({len(found)} live elsewhere)" if found else ""
        return Verdict(False, f"no live {role} {where} in job {job}{note}")
    name, member = max(mine.items(), key=lambda item: item[1].expires_at)
    left = member.expires_at - (time.time() if now is None else now)
    pid = member.info.get("pid", "?")
    return Verdict(
        True,
        f"{role} {name} alive in job {job} (pid {pid} on {member.info.get('host', '?')}, "
        f"health key expires in {max(0.0, left):.0f} s)",
    )


class Beat(ABC):
    """Calls `beat` from a daemon thread every `refresh_s` until `stop`, then `end`.

    A beat that fails with one of `ERRORS` is logged once per outage (not every few seconds)
    and retried; the health record then lapses, which is what makes the role unhealthy.
    """

    ERRORS: tuple[type[Exception], ...] = (SplitMQError,)

    def __init__(
        self, role: str, what: str, refresh_s: float, logger: logging.Logger | None
    ) -> None:
        self._what = what
        self._refresh_s = refresh_s
        self._log = logger or logging.getLogger("splitmq.health")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"health-{role}", daemon=True)

    @abstractmethod
    def beat(self) -> None: ...

    @abstractmethod
    def end(self) -> None:
        """Remove the record (the thread's last step)."""

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> bool:
        """Stop beating; whether the thread has ended (a daemon left in a beat otherwise)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def _run(self) -> None:
        failing = False
        try:
            while True:
                try:
                    self.beat()
                    if failing:
                        self._log.info("%s refreshed again", self._what)
                    failing = False
                except self.ERRORS as exc:
                    if not failing:
                        self._log.warning("cannot refresh %s: %s", self._what, exc)
                    failing = True
                if self._stop.wait(self._refresh_s):
                    break
        finally:
            self.end()


class HealthBeat(Beat):
    """Refreshes the health key `health:<role>:<instance>` of `job` in the store."""

    def __init__(
        self,
        open_store: Callable[[], MemberStore],
        job: str,
        role: str,
        instance: str,
        *,
        refresh_s: float = REFRESH_S,
        ttl_s: float = TTL_S,
    ) -> None:
        if not 0 < refresh_s < ttl_s:
            raise ValueError(f"refresh ({refresh_s} s) must be positive and below the TTL")
        self._member = health_member(role, instance)
        super().__init__(role, f"health key {self._member}", refresh_s, None)
        self._open_store = open_store
        self._store: MemberStore | None = None
        self._job = job
        self._ttl_s = ttl_s
        self._info = {"host": socket.gethostname(), "pid": str(os.getpid())}

    def beat(self) -> None:
        if self._store is None:
            self._store = self._open_store()
        self._store.heartbeat(self._job, self._member, self._ttl_s, self._info)

    def end(self) -> None:
        if self._store is None:
            return
        try:
            self._store.remove_member(self._job, self._member)
        except SplitMQError:
            pass  # it expires on its own
        finally:
            self._store.close()


def _folder(job: str, base: Path | None) -> Path:
    return (base or Path(tempfile.gettempdir()) / "splitmq-health") / job


class FileHealthBeat(Beat):
    """Refreshes one health file from a daemon thread until stopped, then removes it."""

    ERRORS = (OSError,)

    def __init__(
        self,
        job: str,
        role: str,
        instance: str,
        *,
        base: Path | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.path = _folder(job, base) / f"{role}-{instance}.json"
        super().__init__(role, f"health file {self.path}", REFRESH_S, None)
        self._clock = clock
        self._info = {"host": socket.gethostname(), "pid": os.getpid(), "instance": instance}

    def beat(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        scratch = self.path.with_suffix(f".{threading.get_ident()}.tmp")  # one per writer
        scratch.write_text(json.dumps({**self._info, "at": self._clock()}))
        scratch.replace(self.path)  # atomic: a reader never sees half a file

    def end(self) -> None:
        self.path.unlink(missing_ok=True)


def assess_files(
    job: str,
    role: str,
    *,
    instance: str | None = None,
    base: Path | None = None,
    now: float | None = None,
) -> Verdict:
    """Is a `role` process of `job` alive on this machine (the one named `instance`, or any)?"""
    folder = _folder(job, base)
    pattern = f"{role}-{instance}.json" if instance is not None else f"{role}-*.json"
    now = time.time() if now is None else now
    stale = 0
    for path in sorted(folder.glob(pattern)):
        try:
            info = json.loads(path.read_text())
            age = now - float(info["at"])
            pid = int(info["pid"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if age <= TTL_S and _running(pid):
            name = info.get("instance", path.stem)
            return Verdict(
                True, f"{role} {name} alive in job {job} (pid {pid}, beat {age:.0f} s ago)"
            )
        stale += 1
    which = f"named {instance}" if instance is not None else "on this machine"
    note = f" ({stale} stale health file(s) in {folder})" if stale else ""
    return Verdict(False, f"no live {role} {which} in job {job}{note}")


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process, but alive
    return True
