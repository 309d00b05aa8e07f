"""A client host: N simulated clients in one process (`splitmq clients CONFIG --count N`;
docs/architecture.md, "Client hosts").

Each client is the standalone client's loop (`Client.run`) on a thread of its own, seated on
the host's shared connections (services/client/hostlink.py): replies come from one queue per
host, publishes go over a few handles, heartbeats go out as one message per host. The clients
share one dataset and one model code; a model is lent to a client only while it trains a
round (`ModelPool`), and its algorithm memory can wait on disk (`SpilledMemory`), so an idle
client costs a thread and a few small objects.

Availability: each client is online in the intervals its trace gives (services/client/
traces.py; always, without one). Going offline stops its thread and unplugs its seat: it
sends nothing more (no Leave: the coordinator expires it, as it would a device that lost its
network), and its replies are dropped until it comes back, when it joins as a new process.
"""

from __future__ import annotations

import heapq
import json
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Literal

from broker.errors import BrokerError
from broker.transport import Broker, QueueSpec
from services.client.client import Client
from services.client.data import JobData
from services.client.errors import ClientError, ClientSettingsError
from services.client.host_stats import HostStats
from services.client.hostbeat import HostBeat, Roster, SeatBeats
from services.client.hostlink import Dispatcher, Publishers, SeatBroker
from services.client.lending import (
    ComputeGate,
    KeptMemory,
    Memory,
    ModelPool,
    Seat,
    SpilledMemory,
)
from services.client.secured import secured_host_broker
from services.client.stats import ClientStats
from services.common.backends import Backends
from services.common.jobmodel import job_model
from services.common.membership import HOST_INFO_KEY, HOST_QUEUE_INFO_KEY
from services.config.root import Settings
from services.data.loaders import Dataset
from services.security.hidden import host_reply_queue, queue_secret
from services.security.identity import client_host, host_id_problem

# Deliveries the host's consumer may hold unacknowledged: every online client's few replies.
_PREFETCH_PER_CLIENT = 4
_PREFETCH_MAX = 10_000
_TICK_S = 0.2  # how often the scheduler looks at its clock (and at the stop event)

Offline = Literal["vanish", "leave"]
# Client index and id -> its online intervals (seconds from the host's start), sorted.
Intervals = Callable[[int, str], Sequence[tuple[float, float]]]


def always_online(index: int, client: str) -> Sequence[tuple[float, float]]:
    return ((0.0, math.inf),)


def hosted_client_id(host: str, index: int) -> str:
    return f"{host}-{index}"


@dataclass(frozen=True)
class _Shared:
    """What every client of the host shares."""

    dispatcher: Dispatcher
    pool: Publishers
    roster: Roster
    models: ModelPool
    compute: ComputeGate
    queue: str  # the host queue's name, which every Join tells the coordinator


@dataclass
class _Session:
    seat: SeatBroker
    stop: threading.Event
    thread: threading.Thread


@dataclass(eq=False)
class ClientHost:
    """Runs clients `<host>-<first>` .. `<host>-<first + count - 1>`; client `<host>-<i>`
    trains on data partition i when the job has one (else the coordinator assigns one)."""

    settings: Settings
    backends: Backends
    host: str
    count: int
    first: int = 0
    # Client i trains partition i (False: the coordinator assigns free partitions).
    by_index: bool = True
    online: Intervals = always_online
    offline: Offline = "vanish"
    spill_dir: Path | None = None
    dataset: Dataset | JobData | None = None
    # Clients started per second at most (a thousand Joins at once would all wait on the
    # coordinator at the same time).
    join_rate: float = 100.0
    publishers: int = 4
    # Clients at a time in work that waits on nothing (`ComputeGate`); default: 2 per core.
    compute_slots: int = field(default_factory=lambda: 2 * (os.cpu_count() or 1))
    stats_file: Path | None = None  # where `run` writes its stats as JSON at the end
    open_broker: Callable[[str], Broker] | None = None  # the host's handles; default: backends
    logger: logging.Logger = field(default_factory=lambda: logging.getLogger("splitmq.host"))

    def __post_init__(self) -> None:
        problem = host_id_problem(self.host)
        if problem is not None:
            raise ClientSettingsError(f"{problem} (--host)")
        if self.count < 1 or self.first < 0:
            raise ClientSettingsError(
                f"--count {self.count} / --first {self.first}: need >= 1 / >= 0"
            )
        if self.join_rate <= 0 or self.publishers < 1:
            raise ClientSettingsError("join rate must be > 0 and publishers >= 1")
        self._data = (
            self.dataset
            if isinstance(self.dataset, JobData)
            else JobData(self.settings, self.dataset)
        )
        self._memories: dict[str, Memory] = {}
        self._sessions: dict[str, _Session] = {}
        self._lock = threading.Lock()

    def owns(self, client: str) -> bool:
        return client_host(client) == self.host

    def run(self, stop: threading.Event) -> HostStats:
        settings = self.settings
        job = settings.job.name
        stats = HostStats(clients=self.count)
        opener = self.open_broker or partial(
            secured_host_broker, settings, self.backends, self.host
        )
        models = ModelPool(lambda: job_model(settings))
        compute = ComputeGate(self.compute_slots)
        spec = self._queue()
        inbound = opener(f"splitmq-host-{self.host}")
        handles: list[Broker] = []
        dispatcher = Dispatcher(
            inbound,
            spec,
            owns=self.owns,
            prefetch=min(_PREFETCH_MAX, _PREFETCH_PER_CLIENT * self.count),
            logger=self.logger,
        )
        dispatch_stop = threading.Event()
        dispatch_thread = threading.Thread(
            target=dispatcher.run, args=(dispatch_stop,), name=f"host-{self.host}-dispatch"
        )
        roster = Roster()
        beat: HostBeat | None = None
        try:
            dispatcher.open()
            handles = [opener(f"splitmq-host-{self.host}-out{i}") for i in range(self.publishers)]
            pool = Publishers(handles)
            dispatch_thread.start()
            beat = HostBeat(
                pool,
                roster,
                job=job,
                host=self.host,
                interval_s=settings.clients.heartbeat_s,
                probe=spec.name,
                logger=self.logger,
            )
            beat.start()
            self.logger.info(
                "host %s: running clients %s-%d..%d (%d) on %s",
                self.host,
                self.host,
                self.first,
                self.first + self.count - 1,
                self.count,
                spec.name,
            )
            shared = _Shared(dispatcher, pool, roster, models, compute, spec.name)
            self._schedule(stop, stats, shared)
        finally:
            self._stop_all()
            if beat is not None:
                beat.stop()
                stats.beat_messages, stats.beat_members = beat.messages_sent, beat.members_sent
                stats.beat_publish_s = list(beat.publish_s)
            dispatch_stop.set()
            if dispatch_thread.is_alive():
                dispatch_thread.join(10.0)
            stats.dispatch = dispatcher.stats
            stats.models_built = models.built + 1  # the reference model too
            if stats.finished and not settings.security.per_client_users:
                # Over: nothing will be routed to its clients again (a stopped host keeps its
                # queue and bindings for its restart; a secured host's is revoked with its user).
                self._delete_queue(inbound, spec.name)
            for handle in [inbound, *handles]:
                try:
                    handle.close()
                except Exception:
                    self.logger.debug("closing a handle of host %s failed", self.host)
        if self.stats_file is not None:
            self.stats_file.parent.mkdir(parents=True, exist_ok=True)
            self.stats_file.write_text(json.dumps({"host": self.host, **stats.as_json()}))
        total = stats.total()
        self.logger.info(
            "host %s: %s; %d sessions of %d clients, %d rounds, %d batches sent, %d joins; "
            "%d models built",
            self.host,
            stats.job_status or "stopped",
            stats.sessions,
            self.count,
            total.rounds,
            total.batches_sent,
            total.joins_sent,
            stats.models_built,
        )
        return stats

    def _queue(self) -> QueueSpec:
        """The host's queue: in the secured mode under the name its user's password hides
        (services/security/hidden.py), which its clients' Joins tell the coordinator."""
        per_client_users = self.settings.security.per_client_users
        secret = queue_secret(per_client_users, self.backends.broker_settings.amqp_url)
        return host_reply_queue(self.settings.job.name, self.host, secret)

    def _delete_queue(self, broker: Broker, name: str) -> None:
        try:
            broker.delete_queue(name)
        except BrokerError as exc:
            self.logger.warning("host %s: could not delete %s: %s", self.host, name, exc)

    # --- the schedule ---------------------------------------------------------------------------

    def _schedule(self, stop: threading.Event, stats: HostStats, shared: _Shared) -> None:
        """Start and stop clients as their intervals say until the job is over (every online
        client was dismissed, or stopped) or `stop`."""
        events = self._events()
        started = time.monotonic()
        next_start = started  # the join-rate limit
        gap = 1.0 / self.join_rate
        # Clients back online while their last session is still stopping (a short gap in the
        # trace): they start once it has ended, or the new session would be taken for the old.
        returning: dict[int, None] = {}

        def start(index: int) -> bool:
            """Start `index`'s session at the join rate (none once the job is over); False when
            `stop` came meanwhile."""
            nonlocal next_start
            if stats.finished:
                return True
            wait = next_start - time.monotonic()
            if wait > 0 and stop.wait(wait):
                return False
            next_start = max(time.monotonic(), next_start) + gap
            self._go_online(index, hosted_client_id(self.host, index), stats, shared)
            return True

        while not stop.is_set():
            if not self._due(events, time.monotonic() - started, returning, start):
                return
            self._reap()
            for index in [
                i for i in returning if not self._stopping(hosted_client_id(self.host, i))
            ]:
                del returning[index]
                if not start(index):
                    return
            if stats.finished and not self._sessions:
                return
            if not events and not self._sessions and not returning:
                return  # every interval is over
            stop.wait(_TICK_S)

    def _events(self) -> list[tuple[float, int, int]]:
        """Every client's going online and offline as a heap of (time, kind, index): kind 1 =
        online, 0 = offline, so an interval ending when the next starts goes offline first."""
        events: list[tuple[float, int, int]] = []
        for index in range(self.first, self.first + self.count):
            client = hosted_client_id(self.host, index)
            for on, off in self.online(index, client):
                events.append((on, 1, index))
                if math.isfinite(off):
                    events.append((off, 0, index))
        heapq.heapify(events)
        return events

    def _due(
        self,
        events: list[tuple[float, int, int]],
        elapsed: float,
        returning: dict[int, None],
        start: Callable[[int], bool],
    ) -> bool:
        """Apply the events due by `elapsed`; False when a start was interrupted by `stop`."""
        while events and events[0][0] <= elapsed:
            _, kind, index = heapq.heappop(events)
            client = hosted_client_id(self.host, index)
            if kind == 0:
                returning.pop(index, None)
                self._go_offline(client)
            elif self._stopping(client):
                returning[index] = None
            elif not start(index):
                return False
        return True

    def _stopping(self, client: str) -> bool:
        """Whether `client` has a session that was told to stop and has not ended yet."""
        session = self._sessions.get(client)
        return session is not None and session.stop.is_set()

    def _go_online(self, index: int, client: str, stats: HostStats, shared: _Shared) -> None:
        if client in self._sessions:
            return  # overlapping intervals: it is online already
        memory = self._memories.get(client)
        if memory is None:
            memory = (
                KeptMemory()
                if self.spill_dir is None
                else SpilledMemory(self.spill_dir / f"{client}.safetensors")
            )
            self._memories[client] = memory
        seat_broker = SeatBroker(client, shared.dispatcher, shared.pool)
        seat = Seat(
            broker=seat_broker,
            heartbeats=partial(SeatBeats, shared.roster, client),
            models=shared.models,
            memory=memory,
            join_info={HOST_INFO_KEY: self.host, HOST_QUEUE_INFO_KEY: shared.queue},
            compute=shared.compute,
        )
        in_range = index < self.settings.clients.count
        partition = index if self.by_index and in_range else None
        member = Client(
            self.settings,
            self.backends,
            client_id=client,
            partition=partition,
            dataset=self._data,
            seat=seat,
        )
        session_stop = threading.Event()
        per_client = stats.per_client.setdefault(client, ClientStats())
        failed = stats.failed

        def serve() -> None:
            try:
                one = member.run(session_stop)
            except ClientError as exc:
                failed[client] = str(exc)[:300]
                self.logger.warning("host %s: client %s ended: %s", self.host, client, exc)
                return
            with self._lock:
                stats.per_session.append((client, one))
                per_client.add(one)
                if one.join_s:
                    stats.join_s.append(one.join_s)
                if one.finished:
                    stats.finished = True
                    stats.job_status = one.job_status

        thread = threading.Thread(target=serve, name=f"client-{client}", daemon=True)
        self._sessions[client] = _Session(seat_broker, session_stop, thread)
        stats.sessions += 1
        thread.start()

    def _go_offline(self, client: str) -> None:
        session = self._sessions.get(client)
        if session is None:
            return
        session.stop.set()
        if self.offline == "vanish":
            session.seat.unplug()  # nothing more gets out, not even its Leave

    def _reap(self) -> None:
        for client in [c for c, s in self._sessions.items() if not s.thread.is_alive()]:
            del self._sessions[client]

    def _stop_all(self) -> None:
        for session in self._sessions.values():
            session.stop.set()
        for session in self._sessions.values():
            session.thread.join(30.0)
        self._reap()
