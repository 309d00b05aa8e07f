"""`JobWatcher`: follows one job for the dashboard and the job-wide gauges (what it reads, and
how often: docs/deployment.md, "The dashboard"). A broker or store failure is logged and
retried: watching never takes a role down. Without a state to fill (gauges only) it takes no
events.
"""

from __future__ import annotations

import json
import logging
import re
import threading
import time
import uuid
from collections.abc import Mapping
from contextlib import closing
from dataclasses import replace
from pathlib import Path

from broker.codec import decode
from broker.errors import DecodeError
from broker.keys import CLIENT_MEMBER_PREFIX
from broker.messages import Event
from broker.rejection import Rejected, ack_safely, dead_letter_safely
from broker.store import Member, WeightStore
from broker.topology import events_queue, shard_queue_name
from broker.transport import Broker, Delivery
from services.common.backends import Backends
from services.common.leases import WorkerBeat, worker_beat
from services.config.root import Settings
from services.dashboard.state import DashboardState, Probe, RunReport
from services.metrics.recorder import NO_METRICS, Metrics
from services.report.rundir import METRICS_JSON, SUMMARY_FILE

_RETRY_S = 5.0
_REPORT_S = 2.0
_EVENT_WAIT_S = 0.5
# A run directory written to this long before the watch began can still be the current run
# (`splitmq up` creates it before it starts the roles).
_RUN_DIR_SLACK_S = 120.0


def split_members(members: Mapping[str, Member]) -> tuple[list[str], list[WorkerBeat]]:
    clients = sorted(
        m[len(CLIENT_MEMBER_PREFIX) :] for m in members if m.startswith(CLIENT_MEMBER_PREFIX)
    )
    beats = (worker_beat(member) for _, member in sorted(members.items()))
    workers = [beat for beat in beats if beat is not None]
    return clients, workers


def find_run_dir(report_dir: Path, job: str, since: float) -> Path | None:
    """The newest `<job>-<date>-<time>` run directory whose metrics.json changed after `since`
    (a wall-clock time): the run in progress, not an old one of the same job name."""
    pattern = re.compile(re.escape(job) + r"-\d{8}-\d{6}(-\d+)?")
    best: tuple[float, Path] | None = None
    try:
        candidates = list(report_dir.iterdir())
    except OSError:
        return None
    for path in candidates:
        if not pattern.fullmatch(path.name):
            continue
        try:
            mtime = (path / METRICS_JSON).stat().st_mtime
        except OSError:
            continue
        if mtime >= since and (best is None or mtime > best[0]):
            best = (mtime, path)
    return best[1] if best else None


def read_report(run_dir: Path) -> RunReport | None:
    """None while metrics.json is missing or unreadable (it is replaced atomically, so a read
    never sees half a file)."""
    try:
        doc = json.loads((run_dir / METRICS_JSON).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(doc, dict):
        return None
    run = doc.get("run")
    if not isinstance(run, dict):
        run = {}
    records = [r for r in doc.get("records", []) if isinstance(r, dict)]
    try:
        summary = (run_dir / SUMMARY_FILE).read_text(encoding="utf-8")
    except OSError:
        summary = ""
    return RunReport(str(run_dir), str(run.get("status", "")), records, summary)


class JobWatcher:
    def __init__(
        self,
        settings: Settings,
        backends: Backends,
        *,
        state: DashboardState | None = None,
        metrics: Metrics = NO_METRICS,
        live: bool = True,
        run_dir: Path | None = None,
        logger: logging.Logger | None = None,
    ) -> None:
        self._settings = settings
        # Its own traffic is not the role's: unmetered handles.
        self._backends = replace(backends, metrics=NO_METRICS)
        self._state = state
        self._metrics = metrics
        self._live = live
        self._run_dir = run_dir
        self._since = time.time() - _RUN_DIR_SLACK_S
        self._log = logger or logging.getLogger("splitmq.dashboard")
        self._job = settings.job.name
        self._report_done = False
        self.dead_lettered = 0  # deliveries on the events queue that were no Event

    def run(self, stop: threading.Event) -> None:
        if not self._live:
            # Nothing to connect to (an embedded run is over): the run directory only.
            self._since = 0.0
            while not stop.is_set() and not self._report_done:
                self.read_report()
                stop.wait(_REPORT_S)
            return
        while not stop.is_set():
            try:
                self._watch(stop)
            except Exception as exc:
                self._log.warning("job %s: watching failed (%r); retrying", self._job, exc)
                stop.wait(_RETRY_S)

    def _watch(self, stop: threading.Event) -> None:
        with (
            closing(self._backends.open_broker("splitmq-watch")) as broker,
            closing(self._backends.open_store()) as store,
        ):
            broker.declare(self._settings.job_queues())
            if self._state is not None:
                spec = events_queue(self._job, f"watch-{uuid.uuid4().hex[:12]}")
                broker.declare([spec])
                broker.subscribe(spec.name, prefetch=256)
            self._loop(broker, store, stop)

    def _loop(self, broker: Broker, store: WeightStore, stop: threading.Event) -> None:
        probe_s = self._settings.metrics.probe_s
        next_probe = next_report = time.monotonic()
        while not stop.is_set():
            now = time.monotonic()
            if now >= next_probe:
                self.probe(broker, store)
                next_probe = now + probe_s
            if now >= next_report:
                self.read_report()
                next_report = now + _REPORT_S
            wait = max(0.0, min(next_probe, next_report) - time.monotonic())
            if self._state is not None:
                delivery = broker.get(min(wait, _EVENT_WAIT_S))
                if delivery is not None:
                    self._on_delivery(broker, delivery)
            else:
                stop.wait(wait)

    def probe(self, broker: Broker, store: WeightStore) -> None:
        version = store.current_version(self._job)
        clients, workers = split_members(store.live_members(self._job))
        depths = {
            shard: broker.queue_depth(shard_queue_name(self._job, shard))
            for shard in range(self._settings.shards)
        }
        self._metrics.version(version)
        self._metrics.members("client", len(clients))
        self._metrics.members("worker", len(workers))
        for shard, depth in depths.items():
            self._metrics.queue_depth(shard, depth)
        ended = store.job_status(self._job)
        probe = Probe(time.time(), version, clients, workers, depths, ended.text if ended else "")
        if self._state is not None:
            self._state.on_probe(probe)

    def read_report(self) -> None:
        if self._state is None or self._report_done:
            return
        if self._run_dir is None:
            self._run_dir = find_run_dir(
                Path(self._settings.report.dir), self._job, since=self._since
            )
            if self._run_dir is None:
                return
        report = read_report(self._run_dir)
        if report is not None:
            self._state.on_report(report)
            # The report is final once the run ended and the summary is written.
            self._report_done = report.status not in ("", "running") and bool(report.summary)

    def _on_delivery(self, broker: Broker, delivery: Delivery) -> None:
        try:
            message = decode(delivery.body)
        except DecodeError as exc:
            reason = f"undecodable: {exc.reason}"
        else:
            if isinstance(message, Event):
                if self._state is not None:
                    self._state.on_event(message, time.time())
                # A reconnect requeued it if this fails; events are best-effort anyway.
                ack_safely(broker, delivery)
                return
            reason = f"{type(message).__name__} is not an Event"
        if dead_letter_safely(broker, delivery, reason) is not Rejected.REDELIVERED:
            self.dead_lettered += 1
            self._log.warning("job %s: dead-lettered an event: %s", self._job, reason)
