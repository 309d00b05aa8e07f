"""Recorders backed by one Prometheus `CollectorRegistry` per process.

Every family carries `splitmq_job`, and the per-role ones `role` and `member`, so the embedded
runner (every role in one process, one registry) keeps its workers apart. (`splitmq_job`, not
`job`: Prometheus sets `job` on every scraped series itself.)
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from services.metrics.recorder import Meters, Metrics

F = TypeVar("F", Counter, Gauge, Histogram)

ROLE_LABELS = ("splitmq_job", "role", "member")
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
STALENESS_BUCKETS = (0.0, 1.0, 2.0, 3.0, 5.0, 8.0, 13.0, 21.0)


_MARK_EVERY_S = 1.0


class BusyMeter:
    """`fraction()` = 1 - waiting / elapsed over roughly the last `window_s` seconds.

    Waits are credited when they end (a role's `get` returns), so a wait in progress counts as
    busy until then; roles wait at most a poll interval at a time, far below the window. A wait
    that began before the window's baseline mark is credited to the window only from the mark
    on: credited whole, a mostly idle role (the coordinator, busy well under 1 %) read 0.
    """

    def __init__(self, window_s: float = 10.0, clock: Callable[[], float] = time.monotonic):
        self._window_s = window_s
        self._clock = clock
        self._lock = threading.Lock()
        self._waited = 0.0
        # [time, waited before it]: a list, so a wait that spans a mark can move its share.
        self._marks: deque[list[float]] = deque([[clock(), 0.0]])

    def waited(self, seconds: float) -> None:
        seconds = max(0.0, seconds)
        with self._lock:
            now = self._clock()
            began = now - seconds
            for mark in reversed(self._marks):
                if mark[0] <= began:
                    break
                mark[1] += min(seconds, mark[0] - began)  # the part before this mark
            self._waited += seconds
            self._mark(now)

    def fraction(self) -> float:
        with self._lock:
            now = self._clock()
            self._mark(now)
            start, waited_then = self._marks[0]
            elapsed = now - start
            if elapsed <= 0:
                return 0.0
            return min(1.0, max(0.0, 1.0 - (self._waited - waited_then) / elapsed))

    def _mark(self, now: float) -> None:
        if now - self._marks[-1][0] >= _MARK_EVERY_S:
            self._marks.append([now, self._waited])
        # Keep the newest mark at or before the window's start as the baseline.
        while len(self._marks) > 1 and self._marks[1][0] <= now - self._window_s:
            self._marks.popleft()


class _Families:
    """The metric families of one registry (created once: a registry refuses duplicates)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        def family(kind: type[F], name: str, text: str, labels: Sequence[str], **kw: Any) -> F:
            return kind(name, text, labels, registry=registry, **kw)

        role, dead = ROLE_LABELS, (*ROLE_LABELS, "reason")
        self.samples = family(Counter, "splitmq_samples", "Training samples processed.", role)
        self.step = family(
            Histogram,
            "splitmq_step_latency_seconds",
            "Server step latency: forward, backward, optimizer step and replies.",
            role,
            buckets=STEP_BUCKETS,
        )
        self.staleness = family(
            Histogram,
            "splitmq_staleness_versions",
            "Version lag of arriving smashed batches (workers) and updates (aggregator).",
            role,
            buckets=STALENESS_BUCKETS,
        )
        self.dead = family(
            Counter, "splitmq_dead_lettered", "Messages dead-lettered, by reason code.", dead
        )
        self.bytes_in = family(Counter, "splitmq_bytes_in", "Message bytes received.", role)
        self.bytes_out = family(Counter, "splitmq_bytes_out", "Message bytes published.", role)
        self.wait = family(
            Counter,
            "splitmq_wait_seconds",
            "Time spent waiting for work (1 - its rate is the busy fraction).",
            role,
        )
        self.busy = family(
            Gauge,
            "splitmq_busy_fraction",
            "Fraction of the last ~10 s not spent waiting for work.",
            role,
        )
        job = ("splitmq_job",)
        self.queue_depth = family(
            Gauge, "splitmq_queue_depth", "Messages ready in a shard queue.", (*job, "shard")
        )
        self.version = family(Gauge, "splitmq_version", "The job's current weights version.", job)
        self.members = family(Gauge, "splitmq_members", "Live members by kind.", (*job, "kind"))


class PrometheusMeters(Meters):
    """One per process: the registry, and a recorder per role the process runs."""

    def __init__(self, job: str) -> None:
        self.job = job
        self.registry = CollectorRegistry()
        self._families = _Families(self.registry)
        self._lock = threading.Lock()
        self._roles: dict[tuple[str, str], RoleRecorder] = {}
        # Where this process serves /metrics, once it does (workers advertise it).
        self.url = ""

    def job_gauges(self) -> JobGauges:
        """A recorder for the job-wide gauges only (version, members, queue depths): what a
        watcher reports, without a role of its own."""
        return JobGauges(self._families, self.job)

    def role(self, kind: str, member: str = "") -> RoleRecorder:
        with self._lock:
            key = (kind, member or kind)
            recorder = self._roles.get(key)
            if recorder is None:
                recorder = RoleRecorder(self, self._families, kind, member or kind)
                self._roles[key] = recorder
            return recorder


class JobGauges(Metrics):
    """Sets the job-wide gauges; everything a role would report is ignored."""

    enabled = True

    def __init__(self, f: _Families, job: str) -> None:
        self._f = f
        self._job = job

    def queue_depth(self, shard: int, depth: int) -> None:
        self._f.queue_depth.labels(self._job, str(shard)).set(depth)

    def version(self, version: int) -> None:
        self._f.version.labels(self._job).set(version)

    def members(self, kind: str, count: int) -> None:
        self._f.members.labels(self._job, kind).set(count)


class RoleRecorder(JobGauges):
    """`Metrics` for one role (and member) of one job."""

    def __init__(self, meters: PrometheusMeters, f: _Families, kind: str, member: str) -> None:
        super().__init__(f, meters.job)
        labels = (meters.job, kind, member)
        self._meters = meters
        self._labels = labels
        # Bound children up front: every family shows (at zero) from the first scrape.
        self._samples = f.samples.labels(*labels)
        self._step = f.step.labels(*labels)
        self._staleness = f.staleness.labels(*labels)
        self._bytes_in = f.bytes_in.labels(*labels)
        self._bytes_out = f.bytes_out.labels(*labels)
        self._wait = f.wait.labels(*labels)
        self._busy = BusyMeter()
        f.busy.labels(*labels).set_function(self._busy.fraction)
        self._lock = threading.Lock()
        self._samples_total = 0

    def samples(self, n: int) -> None:
        self._samples.inc(n)
        with self._lock:
            self._samples_total += n

    def step(self, seconds: float) -> None:
        self._step.observe(seconds)

    def staleness(self, lag: int) -> None:
        self._staleness.observe(max(0, lag))

    def dead_lettered(self, reason: str) -> None:
        self._f.dead.labels(*self._labels, reason).inc()

    def bytes_in(self, n: int) -> None:
        self._bytes_in.inc(n)

    def bytes_out(self, n: int) -> None:
        self._bytes_out.inc(n)

    def waited(self, seconds: float) -> None:
        self._wait.inc(max(0.0, seconds))
        self._busy.waited(seconds)

    def member_info(self) -> dict[str, str]:
        info = {"samples": str(self._samples_total)}  # a read needs no lock; the += does
        if self._meters.url:
            info["metrics"] = self._meters.url
        return info
