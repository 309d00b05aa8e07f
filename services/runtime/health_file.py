"""Health of an edge client: a file on its own machine, never a key in Redis.

Clients talk only to RabbitMQ (design §3): they hold no Redis credentials, so `splitmq client`
proves it is alive by refreshing `<tmp>/splitmq-health/<job>/client-<instance>.json` (its host,
pid and the time) every `REFRESH_S`, and `splitmq check client` reads it on the same machine,
which is where a container healthcheck runs. A file older than `TTL_S`, or whose process is
gone, is unhealthy.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

from services.common.health import REFRESH_S, TTL_S, Beat, Verdict


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
        refresh_s: float = REFRESH_S,
        clock: Callable[[], float] = time.time,
        logger: logging.Logger | None = None,
    ) -> None:
        self.path = _folder(job, base) / f"{role}-{instance}.json"
        super().__init__(role, f"health file {self.path}", refresh_s, logger)
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
    ttl_s: float = TTL_S,
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
        if age <= ttl_s and _running(pid):
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
