"""Workers as local processes, for machines without Docker (docs/deployment.md, "Backends").
Each runs in its own session, so a Ctrl-C to the autoscaler is not also a SIGTERM to every
worker.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import services
from services.autoscaler.pool import Exited, PoolWorker


def role_env(base: Mapping[str, str]) -> dict[str, str]:
    """`base`, plus unbuffered output and this code on PYTHONPATH: a child imports the same
    code as this process, installed or run from a checkout (`splitmq up` uses it too)."""
    env = dict(base)
    env["PYTHONUNBUFFERED"] = "1"
    root = str(Path(services.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    return env


@dataclass
class _Process:
    process: subprocess.Popen[bytes]
    log: IO[bytes] | None
    stopping: bool = False


class LocalProcessPool:
    """`WorkerPool` of child processes; worker ids are `<prefix>-<n>`."""

    def __init__(
        self,
        config: Path,
        env: Mapping[str, str],
        *,
        prefix: str,
        log_dir: Path | None = None,
        stop_timeout_s: float = 120.0,
    ) -> None:
        self._config = config
        self._env = role_env(env)
        self._prefix = prefix
        self._log_dir = log_dir
        self._stop_timeout_s = stop_timeout_s
        self._log = logging.getLogger("splitmq.autoscaler")
        self._next = 0
        self._children: dict[str, _Process] = {}

    def workers(self) -> list[PoolWorker]:
        return [PoolWorker(name, name, stopping=c.stopping) for name, c in self._children.items()]

    def start_worker(self) -> PoolWorker:
        name = f"{self._prefix}-{self._next}"
        self._next += 1
        argv = [sys.executable, "-m", "services.cli.main", "worker", str(self._config)]
        argv += ["--id", name]
        log: IO[bytes] | None = None
        if self._log_dir is not None:
            self._log_dir.mkdir(parents=True, exist_ok=True)
            log = (self._log_dir / f"{name}.log").open("ab")
        try:
            process = subprocess.Popen(
                argv,
                env=self._env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT if log is not None else None,
                start_new_session=True,
            )
        except BaseException:
            if log is not None:
                log.close()
            raise
        self._children[name] = _Process(process, log)
        return PoolWorker(name, name)

    def stop_worker(self, name: str) -> None:
        child = self._children[name]
        if not child.stopping:
            child.stopping = True
            with suppress(OSError):  # it exited meanwhile
                child.process.send_signal(signal.SIGTERM)

    def reap(self) -> list[Exited]:
        gone = []
        for name, child in list(self._children.items()):
            code = child.process.poll()
            if code is None:
                continue
            del self._children[name]
            if child.log is not None:
                child.log.close()
            gone.append(Exited(name, code))
        return gone

    def close(self) -> None:
        """Stop every worker gracefully; one still running after `stop_timeout_s` is killed
        (the autoscaler is going away; a killed worker's batches are redelivered, design §7).
        `reap` then reports them all."""
        for name in list(self._children):
            self.stop_worker(name)
        deadline = time.monotonic() + self._stop_timeout_s
        for name, child in list(self._children.items()):
            try:
                child.process.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self._log.warning(
                    "worker %s still running %.0f s after SIGTERM; killing it",
                    name,
                    self._stop_timeout_s,
                )
                with suppress(OSError):
                    child.process.send_signal(signal.SIGKILL)
                child.process.wait()
