"""`splitmq up`: the roles of one job as local OS processes over RabbitMQ and Redis.

Each child is `python -m services.cli.main <role> CONFIG ...` in its own session (so a Ctrl-C
reaches only `up`, which then stops the children in order), with its output prefixed by its
name. The job is over when the aggregator exits; the others then get SIGTERM, and SIGKILL
after a grace period. A worker that dies while the job runs is started again (`restarts`
times at most): workers are a pool whose shards are leased, so its successor, or itself
restarted, takes its shards over from their checkpoints. Any other role that dies ends the job.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import closing, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from broker.store import MemberKind
from broker.topology import client_queue_names
from services.autoscaler.local import role_env
from services.common.backends import Backends
from services.common.supervise import Outcome
from services.config.root import Settings
from services.config.runtime import RuntimeSection
from services.runtime.threads import sharing_env

Echo = Callable[[str], None]
_POLL_S = 0.2
# How often `up` starts a dead worker again before it gives the job up.
WORKER_RESTARTS = 3
# The roles `up` restarts when they die: the leased, scalable ones.
RESTARTED_ROLES = frozenset({"worker"})


@dataclass(frozen=True)
class ChildSpec:
    name: str  # "worker-1": the output prefix
    role: str  # the CLI subcommand
    args: tuple[str, ...] = ()


@dataclass
class Child:
    spec: ChildSpec
    process: subprocess.Popen[str]
    pump: threading.Thread


def child_specs(
    workers: int, clients: int, run_dir: Path, *, resume: bool = False
) -> list[ChildSpec]:
    """Aggregator first (it seeds version 1), then coordinator, workers, clients. `resume`:
    the aggregator goes on with the run in `run_dir`."""
    report = ("--run-dir", str(run_dir), "--no-summary", *(("--resume",) if resume else ()))
    specs = [
        # `up` prints the summary itself, after everything stopped.
        ChildSpec("aggregator", "aggregator", report),
        ChildSpec("coordinator", "coordinator"),
    ]
    specs += [ChildSpec(f"worker-{i}", "worker", ("--id", f"worker-{i}")) for i in range(workers)]
    specs += [
        ChildSpec(f"client-{i}", "client", ("--id", f"client-{i}", "--partition", str(i)))
        for i in range(clients)
    ]
    return specs


def child_env(
    base: Mapping[str, str],
    *,
    workers: int,
    clients: int,
    min_to_start: int | None = None,
    runtime: RuntimeSection | None = None,
) -> dict[str, str]:
    """The children's environment: real broker/store, the counts `up` was given, unbuffered,
    and their thread budget: the host's cores divided among the workers and clients, which
    compute at once (the aggregator and the coordinator mostly wait on them and get the same
    share). `runtime`: the file's [runtime] (default: its defaults)."""
    env = sharing_env(role_env(base), runtime or RuntimeSection(), workers + clients)
    env["SPLITMQ_BROKER"] = "rabbitmq"
    env["SPLITMQ_STORE"] = "redis"
    env["SPLITMQ_WORKERS__COUNT"] = str(workers)
    env["SPLITMQ_CLIENTS__COUNT"] = str(clients)
    if min_to_start is not None:
        env["SPLITMQ_CLIENTS__MIN_TO_START"] = str(min_to_start)
    return env


def clear_job(
    settings: Settings, client_ids: Sequence[str], backends: Backends | None = None
) -> None:
    """Delete the job's queues and store keys, so a stale earlier run cannot leak into this one.

    `backends`: where they live (default: the settings' servers; tests pass embedded ones)."""
    backends = backends or Backends(settings.broker, settings.store)
    _delete_queues(settings, client_ids, backends)
    with closing(backends.open_store()) as store:
        store.delete_job(settings.job.name)


def job_version(settings: Settings) -> int:
    """The job's current version in the store (`NO_VERSION`: none)."""
    backends = Backends(settings.broker, settings.store)
    with closing(backends.open_store(give_up_after=10.0)) as store:
        return store.current_version(settings.job.name)


def reset_for_resume(
    settings: Settings, client_ids: Sequence[str], backends: Backends | None = None
) -> None:
    """Ready a stopped job to go on (`splitmq up --resume`): its versions and the workers'
    checkpoints stay; its queues go (the stopped round's assignments and batches would reach
    the resumed round's new processes, which are not its cohort), so do its client and worker
    members (processes that are gone: a round must not wait for them) and how it ended (a
    finished job resumed with more rounds trains them)."""
    job = settings.job.name
    backends = backends or Backends(settings.broker, settings.store)
    _delete_queues(settings, client_ids, backends)
    with closing(backends.open_store()) as store:
        for kind in (MemberKind.CLIENT, MemberKind.WORKER):
            for member in store.live_members(job, kind):
                store.remove_member(job, member)
        store.clear_job_status(job)


def _delete_queues(settings: Settings, client_ids: Sequence[str], backends: Backends) -> None:
    job = settings.job.name
    with closing(backends.open_broker("splitmq-up", give_up_after=10.0)) as broker:
        names = [q.name for q in settings.job_queues()]
        # The inference reply queues too: `provision-clients` declares them durable, so a
        # stale run's answers would otherwise wait there for this run's clients.
        names += [name for c in client_ids for name in client_queue_names(job, c)]
        for name in names:
            broker.delete_queue(name)


class LocalProcesses:
    """Starts, watches and stops the children of one `splitmq up`."""

    def __init__(
        self,
        config: Path,
        specs: Sequence[ChildSpec],
        env: Mapping[str, str],
        *,
        echo: Echo,
        extra_args: Sequence[str] = (),
        python: str = sys.executable,
        client_grace_s: float = 15.0,
        stop_grace_s: float = 10.0,
        restarts: int = WORKER_RESTARTS,
    ) -> None:
        self._config = config
        self._specs = list(specs)
        self._env = dict(env)
        self._echo = echo
        self._extra = tuple(extra_args)
        self._python = python
        self._client_grace_s = client_grace_s
        self._stop_grace_s = stop_grace_s
        self._restarts = restarts
        self._restarted: dict[str, int] = {}  # child name -> restarts so far
        self._children: list[Child] = []
        self._echo_lock = threading.Lock()
        self._width = max((len(s.name) for s in specs), default=0)

    def start(self) -> None:
        """Start every child; if one cannot be started, stop those already running."""
        try:
            for spec in self._specs:
                self._children.append(self._spawn(spec))
        except BaseException:
            self.stop()
            raise

    def _spawn(self, spec: ChildSpec) -> Child:
        argv = [self._python, "-m", "services.cli.main", spec.role, str(self._config)]
        argv += [*spec.args, *self._extra]
        process = subprocess.Popen(
            argv,
            env=self._env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            bufsize=1,
            start_new_session=True,
        )
        assert process.stdout is not None
        pump = threading.Thread(target=self._pump, args=(spec.name, process.stdout), daemon=True)
        pump.start()
        return Child(spec, process, pump)

    def wait(self, stop: threading.Event, timeout_s: float = 0.0) -> Outcome:
        """Until the aggregator exits (then stop the rest), a child fails, `stop`, or timeout."""
        deadline = time.monotonic() + timeout_s if timeout_s > 0 else None
        status = self._watch(stop, deadline)
        self.stop()
        codes = {c.spec.name: c.process.returncode for c in self._children}
        return Outcome(status, exit_codes=codes)

    def _watch(self, stop: threading.Event, deadline: float | None) -> str:
        finished_at: float | None = None
        try:
            while True:
                if stop.wait(_POLL_S):
                    return "stopped"
                for i, child in enumerate(self._children):
                    code = child.process.poll()
                    if code is not None and code != 0:
                        if not self._may_restart(child):
                            return f"failed: {child.spec.name} exited with code {code}"
                        self._children[i] = self._restart(child, code)
                aggregator = next(c for c in self._children if c.spec.name == "aggregator")
                if aggregator.process.poll() == 0:
                    finished_at = finished_at if finished_at is not None else time.monotonic()
                    clients = [c for c in self._children if c.spec.role == "client"]
                    idle = all(c.process.poll() is not None for c in clients)
                    if idle or time.monotonic() - finished_at > self._client_grace_s:
                        return "finished"
                if deadline is not None and time.monotonic() > deadline:
                    return "timeout"
        except KeyboardInterrupt:
            return "stopped"

    def _may_restart(self, child: Child) -> bool:
        """A dead worker is restarted while the job runs (the aggregator has not exited: after
        it, the job is over) and it has restarts left."""
        if child.spec.role not in RESTARTED_ROLES:
            return False
        aggregator = next((c for c in self._children if c.spec.name == "aggregator"), None)
        if aggregator is not None and aggregator.process.poll() is not None:
            return False
        return self._restarted.get(child.spec.name, 0) < self._restarts

    def _restart(self, child: Child, code: int) -> Child:
        """`child` started again under its name and arguments (a worker keeps its id: its
        leases, expired or not, are its own again)."""
        n = self._restarted.get(child.spec.name, 0) + 1
        self._restarted[child.spec.name] = n
        self._say(
            "up",
            f"{child.spec.name} exited with code {code}; restarting it ({n} of {self._restarts})",
        )
        child.pump.join(5.0)  # its last lines first
        return self._spawn(child.spec)

    @property
    def restarts(self) -> dict[str, int]:
        """How often each child was restarted (those never restarted are absent)."""
        return dict(self._restarted)

    def stop(self) -> None:
        """SIGTERM every child still running, SIGKILL those still there after the grace."""
        running = [c for c in self._children if c.process.poll() is None]
        for child in running:
            with suppress(OSError):  # it exited meanwhile
                child.process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + self._stop_grace_s
        for child in running:
            try:
                child.process.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self._say("up", f"{child.spec.name} ignored SIGTERM; killing it")
                with suppress(OSError):
                    child.process.send_signal(signal.SIGKILL)
                child.process.wait()
        for child in self._children:
            child.pump.join(5.0)

    def _pump(self, name: str, stream: IO[str]) -> None:
        for line in stream:
            self._say(name, line.rstrip("\n"))
        stream.close()

    def _say(self, name: str, line: str) -> None:
        with self._echo_lock:
            self._echo(f"{name:<{self._width}} | {line}")
