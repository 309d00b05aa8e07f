"""The autoscaler role: every `poll_s`, observe, decide (services/autoscaler/policy.py), act.

A worker counts as starting until its first heartbeat (or `start_grace_s`: a FedAvg worker,
having nothing to serve, never heartbeats) and as stopping until the backend saw it exit;
meanwhile the policy holds. Its health key is beaten from the loop (docs/deployment.md,
"Health checks").
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Literal, Protocol

from broker.errors import SplitMQError
from broker.store import MemberKind, WeightStore
from broker.topology import shard_queue_name
from broker.transport import Broker
from services.autoscaler.docker_pool import DockerUnavailableError
from services.autoscaler.policy import Decision, Observation, PolicyState, capped, decide
from services.autoscaler.pool import PoolWorker, WorkerPool
from services.common.backends import Backends
from services.common.health import TTL_S, HealthBeat
from services.common.leases import WorkerBeat, worker_beat
from services.config.root import Settings

Action = Literal["start", "stop", "exited"]
ROLE = "autoscaler"
_NUMBER = re.compile(r"\d+(?:\.\d+)?")


@dataclass(frozen=True)
class Snapshot:
    depths: dict[int, int]  # ready messages by shard
    workers: dict[str, WorkerBeat]  # live workers by id

    @property
    def depth(self) -> int:
        return sum(self.depths.values())

    @property
    def busy(self) -> float | None:
        """Mean busy fraction of the workers that report one."""
        values = [w.busy for w in self.workers.values() if w.busy is not None]
        return sum(values) / len(values) if values else None


class Observer:
    """Reads one job's shard queues and worker heartbeats (why both: docs/deployment.md,
    "Autoscaling workers"); owns neither handle."""

    def __init__(self, broker: Broker, store: WeightStore, settings: Settings) -> None:
        self._broker = broker
        self._store = store
        self._settings = settings
        self._job = settings.job.name
        self._declared = False

    def snapshot(self) -> Snapshot:
        if not self._declared:
            # Idempotent, with the workers' own arguments: a passive declare of a queue that
            # does not exist yet would close the channel.
            self._broker.declare(self._settings.job_queues())
            self._declared = True
        try:
            depths = {
                s: self._broker.queue_depth(shard_queue_name(self._job, s))
                for s in range(self._settings.shards)
            }
        except Exception:
            self._declared = False  # e.g. a queue deleted under us: declare again next time
            raise
        workers = self._store.live_members(self._job, MemberKind.WORKER)
        beats = (worker_beat(m) for m in workers.values())
        return Snapshot(depths, {beat.worker: beat for beat in beats if beat is not None})


class SnapshotSource(Protocol):
    def snapshot(self) -> Snapshot: ...


@dataclass(frozen=True)
class ScalingEvent:
    at: float  # the autoscaler's clock
    action: Action
    worker: str
    running: int  # workers up and not stopping, after the action
    reason: str


class Autoscaler:
    """Sizes `pool` for one job; `run` it on the thread that will own its broker handle."""

    def __init__(
        self,
        settings: Settings,
        backends: Backends,
        pool: WorkerPool,
        *,
        start_grace_s: float = 300.0,
        instance: str = ROLE,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings = settings
        self.limits = capped(settings.autoscaler, settings.shards)
        self.pool = pool
        self.events: list[ScalingEvent] = []
        self.running = 0  # as of the last step
        self.state = PolicyState()
        self._backends = backends
        self._start_grace_s = start_grace_s
        self._clock = clock
        self._log = logging.getLogger("splitmq.autoscaler")
        self._started: dict[str, float] = {}  # started by us, no heartbeat seen yet
        self._last_reason = ""
        self._instance = instance

    def run(self, stop: threading.Event) -> list[ScalingEvent]:
        """Until `stop`; then the pool is closed (local workers stop, containers stay)."""
        settings = self.settings
        if self.limits.max_workers < settings.autoscaler.max_workers:
            self._log.info(
                "job %s has %d shards: at most %d workers (not %d)",
                settings.job.name,
                settings.shards,
                self.limits.max_workers,
                settings.autoscaler.max_workers,
            )
        try:
            with ExitStack() as closing:  # closes each of them, last opened first
                broker = self._backends.open_broker("splitmq-autoscaler")
                closing.callback(broker.close)
                store = self._backends.open_store()
                closing.callback(store.close)
                # Beaten from this loop, not its thread. The health key must lapse during an
                # outage, and removing it at exit must not wait one out: a raw store for it, as
                # the other roles' health beats use. A few polls' worth of TTL at least: a slow
                # poll_s must not read as a dead autoscaler.
                health = HealthBeat(
                    lambda: self._backends.open_store(wait=False),
                    settings.job.name,
                    ROLE,
                    self._instance,
                    ttl_s=max(TTL_S, 3 * settings.autoscaler.poll_s),
                )
                closing.callback(health.end)
                observer = Observer(broker, store, settings)
                while not stop.is_set():
                    try:
                        self.step(observer)
                        health.beat()
                    except (SplitMQError, DockerUnavailableError) as exc:
                        self._log.warning("autoscaler: %s; trying again", exc)
                    stop.wait(settings.autoscaler.poll_s)
        finally:
            self.pool.close()
            for exited in self.pool.reap():
                self._record("exited", exited.name, f"exit code {exited.code}")
        return self.events

    def step(self, observer: SnapshotSource) -> Decision:
        now = self._clock()
        for exited in self.pool.reap():
            level = logging.INFO if exited.code == 0 else logging.WARNING
            self._log.log(level, "worker %s exited with code %s", exited.name, exited.code)
            self._started.pop(exited.name, None)
            self._record("exited", exited.name, f"exit code {exited.code}")
        snapshot = observer.snapshot()
        workers = self.pool.workers()
        active = [w for w in workers if not w.stopping]
        self.running = len(active)
        observation = Observation(
            depth=snapshot.depth,
            busy=snapshot.busy,
            running=len(active),
            starting=self._starting(active, snapshot, now),
            stopping=len(workers) - len(active),
        )
        decision = decide(observation, self.limits, self.state, now)
        self.state = decision.state
        self._log.debug("autoscaler: %s -> %s (%s)", observation, decision.target, decision.reason)
        delta = decision.target - len(active)
        # A hold is logged when its rule changes, not each time its figures do ("at the
        # maximum of 3 (workers 54% busy)" would otherwise be a line every poll).
        gist = _NUMBER.sub("#", decision.reason)
        if delta == 0 and gist != self._last_reason:
            self._log.info("autoscaler: %d workers, %s", len(active), decision.reason)
        self._last_reason = gist
        for _ in range(delta):
            worker = self.pool.start_worker()
            self._started[worker.name] = now
            self.running += 1
            self._record("start", worker.name, decision.reason)
        if delta < 0:
            for victim in self._victims(active, snapshot, -delta):
                self.pool.stop_worker(victim.name)
                self.running -= 1
                self._record("stop", victim.name, decision.reason)
        return decision

    def _starting(self, active: list[PoolWorker], snapshot: Snapshot, now: float) -> int:
        count = 0
        for worker in active:
            started = self._started.get(worker.name)
            if started is None:
                continue
            if any(worker.owns(i) for i in snapshot.workers) or now - started > self._start_grace_s:
                del self._started[worker.name]
            else:
                count += 1
        return count

    def _victims(self, active: list[PoolWorker], snapshot: Snapshot, n: int) -> list[PoolWorker]:
        """Shard-less workers first, then the least busy, then the newest."""

        def key(item: tuple[int, PoolWorker]) -> tuple[bool, float, int]:
            index, worker = item
            reports = [r for i, r in snapshot.workers.items() if worker.owns(i)]
            holds = any(r.shards for r in reports)
            busy = max((r.busy or 0.0 for r in reports), default=0.0)
            return holds, busy, -index

        ranked = sorted(enumerate(active), key=key)
        return [worker for _, worker in ranked[:n]]

    def _record(self, action: Action, worker: str, reason: str) -> None:
        event = ScalingEvent(self._clock(), action, worker, self.running, reason)
        self.events.append(event)
        self._log.info("autoscaler: %s %s (%s); %d workers", action, worker, reason, self.running)
