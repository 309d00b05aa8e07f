"""What the dashboard shows, accumulated from events, probes and the run directory.

Thread-safe: the watcher thread writes, HTTP request threads read `snapshot()`. Series are
bounded (`MAX_POINTS`), so a dashboard left open for days stays small. `dashboard_routes` serves
it: the page itself and the state as JSON.
"""

from __future__ import annotations

import json
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

from broker.messages import Event
from services.common.leases import WorkerBeat
from services.metrics.endpoint import Route
from services.report.tables import finite

# Throughput is the growth of the workers' sample counters over this window: their heartbeats
# refresh the counters only every few seconds.
THROUGHPUT_WINDOW_S = 10.0
MAX_EVENTS = 200
MAX_POINTS = 3600

# Per-version fields taken from `version_published` events and metrics.json records.
VERSION_FIELDS = (
    "round",
    "global_accuracy",
    "personal_accuracy",
    "global_loss",
    "train_loss",
    "samples",
    "samples_per_s",
    "participants",
    "late_updates",
)


@dataclass(frozen=True)
class Probe:
    """One look at the job: the store's version and members, the shard queues' depths."""

    at: float  # wall clock
    version: int
    clients: Sequence[str]
    workers: Sequence[WorkerBeat]
    depths: Mapping[int, int]
    ended: str = ""  # the store's `JobStatus` text once the job ended ("finished", "failed: ...")


@dataclass(frozen=True)
class RunReport:
    """What the run directory says (written by the aggregator)."""

    run_dir: str
    status: str
    records: Sequence[Mapping[str, Any]]
    summary: str = ""


@dataclass
class _Series:
    t: deque[float]
    values: dict[str, deque[float | None]] = field(default_factory=dict)

    def add(self, at: float, row: Mapping[str, float | None], maxlen: int) -> None:
        n = len(self.t)
        self.t.append(at)
        for name in set(self.values) | set(row):
            column = self.values.get(name)
            if column is None:
                # A series that appears late (a new shard) is padded to line up with t.
                column = deque([None] * n, maxlen=maxlen)
                self.values[name] = column
            column.append(row.get(name))


def _number(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


class DashboardState:
    def __init__(
        self,
        job: str,
        info: Mapping[str, Any] | None = None,
        *,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.job = job
        self._info = dict(info or {})
        self._clock = clock
        self._started = clock()
        self._lock = threading.Lock()
        self._series = _Series(deque(maxlen=MAX_POINTS))
        self._events: deque[dict[str, Any]] = deque(maxlen=MAX_EVENTS)
        self._versions: dict[int, dict[str, Any]] = {}
        self._joined = 0
        self._left = 0
        self._last: Probe | None = None
        self._worker_samples: dict[str, int] = {}
        self._trained = 0  # samples the workers trained since this dashboard started
        self._trained_at: deque[tuple[float, int]] = deque(maxlen=MAX_POINTS)
        self._finished: dict[str, Any] | None = None
        self._report: RunReport | None = None

    def on_event(self, event: Event, at: float) -> None:
        """A notice from the events fanout, received `at` (wall clock); other jobs' are ignored."""
        if event.job != self.job:
            return
        with self._lock:
            self._events.append(
                {
                    "t": at - self._started,
                    "kind": event.kind,
                    "client": event.client,
                    "version": event.version,
                    "data": dict(event.data),
                }
            )
            if event.kind == "member_joined":
                self._joined += 1
            elif event.kind == "member_left":
                self._left += 1
            elif event.kind == "version_published":
                self._version_row(event.version, event.data).setdefault("t", at - self._started)
            elif event.kind == "job_finished":
                status = event.data.get("status")
                self._finished = {
                    "t": at - self._started,
                    "version": event.version,
                    # "finished" or "failed: <reason>" (older aggregators sent none: finished).
                    "status": status if isinstance(status, str) and status else "finished",
                }

    def on_probe(self, probe: Probe) -> None:
        with self._lock:
            self._last = probe
            self._count_trained(probe)
            row: dict[str, float | None] = {
                "version": float(probe.version),
                "clients": float(len(probe.clients)),
                "workers": float(len(probe.workers)),
                "throughput": self._throughput(probe.at),
            }
            for shard, depth in probe.depths.items():
                row[f"queue.{shard}"] = float(depth)
            self._series.add(probe.at - self._started, row, MAX_POINTS)

    def on_report(self, report: RunReport) -> None:
        with self._lock:
            self._report = report
            for record in report.records:
                version = record.get("version")
                if isinstance(version, int):
                    self._version_row(version, record)

    def _version_row(self, version: int, values: Mapping[str, Any]) -> dict[str, Any]:
        """`version`'s row, updated with the `VERSION_FIELDS` that `values` has."""
        row = self._versions.setdefault(version, {"version": version})
        row.update({name: values[name] for name in VERSION_FIELDS if values.get(name) is not None})
        return row

    def _count_trained(self, probe: Probe) -> None:
        for worker in probe.workers:
            if worker.samples is None:
                continue
            before = self._worker_samples.get(worker.worker, 0)
            # A restarted worker counts from zero again.
            grown = worker.samples - before if worker.samples >= before else worker.samples
            self._trained += grown
            self._worker_samples[worker.worker] = worker.samples
        self._trained_at.append((probe.at, self._trained))

    def _throughput(self, now: float) -> float | None:
        if len(self._trained_at) < 2:
            return None
        base_t, base_n = self._trained_at[0]
        for t, n in self._trained_at:
            if t >= now - THROUGHPUT_WINDOW_S:
                break
            base_t, base_n = t, n
        elapsed = now - base_t
        return (self._trained - base_n) / elapsed if elapsed > 0 else None

    def _status(self) -> str:
        if self._report is not None and self._report.status not in ("", "running"):
            return self._report.status
        if self._finished is not None:
            return str(self._finished["status"])
        if self._last is not None and self._last.ended:
            return self._last.ended  # ended before this dashboard saw the event
        return "running"

    def snapshot(self) -> dict[str, Any]:
        """Everything the page draws, JSON-ready (times in seconds since the watch began)."""
        with self._lock:
            last = self._last
            series = {
                "t": list(self._series.t),
                **{name: list(column) for name, column in sorted(self._series.values.items())},
            }
            versions = [
                {k: (_number(v) if k != "version" else v) for k, v in row.items()}
                for _, row in sorted(self._versions.items())
            ]
            report = self._report
            return {
                "job": self.job,
                "info": self._info,
                "started": self._started,
                "now": self._clock() - self._started,
                "status": self._status(),
                "version": last.version if last else max(self._versions, default=0),
                "clients": sorted(last.clients) if last else [],
                "workers": [vars(w) for w in last.workers] if last else [],
                "members": {"joined": self._joined, "left": self._left},
                "series": series,
                "versions": versions,
                "events": list(reversed(self._events)),
                "finished": self._finished,
                "report": (
                    None
                    if report is None
                    else {
                        "run_dir": report.run_dir,
                        "status": report.status,
                        "summary": report.summary,
                    }
                ),
            }


def state_json(state: DashboardState) -> bytes:
    return json.dumps(finite(state.snapshot()), default=str, separators=(",", ":")).encode()


def dashboard_routes(state: DashboardState) -> dict[str, Route]:
    html = resources.files("services.dashboard").joinpath("dashboard.html").read_bytes()

    def index() -> tuple[str, bytes]:
        return "text/html; charset=utf-8", html

    def api_state() -> tuple[str, bytes]:
        return "application/json", state_json(state)

    return {"/": index, "/index.html": index, "/api/state": api_state}
