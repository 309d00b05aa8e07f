"""The coordinator role: membership of one job (Join / Leave / Heartbeat / HostHeartbeat /
expiry; docs/architecture.md, step 2 and "Client hosts"). The store holds the record, so a
restarted coordinator, or the aggregator reading cohorts, sees the same members; the
coordinator keeps an index of it, so that an event costs no read of every member (roster.py).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from contextlib import closing
from dataclasses import dataclass, field
from typing import TypeVar

from broker.codec import decode
from broker.errors import DecodeError
from broker.messages import Heartbeat, HostHeartbeat, Join, Leave
from broker.rejection import Rejected, ack_safely, dead_letter_safely
from broker.store import WeightStore
from broker.topology import control_queue_name
from broker.transport import Broker, Delivery
from services.common.backends import Backends
from services.common.checks.addressing import wrong_type
from services.common.checks.chain import Check, first_rejection
from services.common.logs import log_context
from services.common.membership import MemberInfo
from services.common.outbox import Outbox
from services.common.schedule import COORDINATOR_STREAM, MemberEvent, ScheduleLog
from services.config.root import Settings
from services.coordinator.checks import ControlChecks
from services.coordinator.hosts import HostBindings
from services.coordinator.joining import JoinDesk, open_round
from services.coordinator.roster import Roster
from services.coordinator.welcomes import REWELCOME_S, WelcomeLimit
from services.security.identity import sender_check, service_user

_PREFETCH = 32
M = TypeVar("M", Join, Heartbeat, HostHeartbeat, Leave)


@dataclass(frozen=True)
class _Run:
    """What one serving run works with (all of the coordinator's thread)."""

    broker: Broker
    store: WeightStore
    roster: Roster
    outbox: Outbox
    desk: JoinDesk
    hosts: HostBindings
    schedule: ScheduleLog
    # Joins of a new session that came too soon after the client's last Welcome: the latest
    # per client, with when it may be welcomed (`welcomes.py`).
    deferred: dict[str, tuple[float, Join]] = field(default_factory=dict)


@dataclass
class CoordinatorStats:
    """Counters of one run (only the coordinator's thread writes them)."""

    joined: int = 0
    rejoined: int = 0
    refused: int = 0  # joins answered with an Error (job full)
    withheld: int = 0  # joins recorded without a second Welcome (welcomes.py)
    replays: int = 0  # joins dead-lettered as replayed
    deferred: int = 0  # joins of a new session answered after the interval (welcomes.py)
    left: int = 0
    expired: int = 0
    heartbeats: int = 0
    host_heartbeats: int = 0  # HostHeartbeat messages handled
    host_members: int = 0  # members they renewed
    unknown_heartbeats: int = 0  # of a Heartbeat, or a member a HostHeartbeat listed
    dead_lettered: int = 0


class Coordinator:
    def __init__(
        self,
        settings: Settings,
        backends: Backends,
        *,
        clock: Callable[[], float] = time.monotonic,
        poll_s: float = 0.2,
        rewelcome_s: float = REWELCOME_S,
    ) -> None:
        self._settings = settings
        self._backends = backends
        self._clock = clock
        self._log = logging.getLogger("splitmq.coordinator")
        self._poll_s = poll_s
        self._rewelcome_s = rewelcome_s
        self.stats = CoordinatorStats()
        self._checks = ControlChecks.of(settings.job.name, sender_check(settings))

    @property
    def job(self) -> str:
        return self._settings.job.name

    def run(self, stop: threading.Event) -> CoordinatorStats:
        user = service_user(self._settings)
        with (
            closing(self._backends.open_broker("coordinator", stamp=user)) as broker,
            closing(self._backends.open_store()) as store,
        ):
            broker.declare(self._settings.job_queues())
            # Joins wait in the queue until the aggregator has published version 1.
            while store.current_version(self.job) < 1:
                if stop.wait(self._poll_s):
                    return self.stats
            broker.subscribe(control_queue_name(self.job), prefetch=_PREFETCH)
            self._log.info("job %s: coordinator serving %s", self.job, control_queue_name(self.job))
            self._serve(broker, store, stop)
        return self.stats

    def _serve(self, broker: Broker, store: WeightStore, stop: threading.Event) -> None:
        outbox = Outbox(broker, self.job, self._log)
        clients = self._settings.clients
        limit = WelcomeLimit(self._clock, self._rewelcome_s)
        # The coordinator's stream of the run's schedule record: joins, leaves, drops.
        schedule = ScheduleLog(store, self.job, COORDINATOR_STREAM)
        roster = Roster(
            store,
            self.job,
            count=clients.count,
            ttl_s=clients.heartbeat_ttl_s,
            expired=lambda gone: self._announce_expired(store, outbox, limit, gone),
            clock=self._clock,
            expired_members=lambda gone: self._record_drops(store, schedule, gone),
        )
        desk = JoinDesk(self._settings, store, roster, outbox, self._log, limit, schedule)
        hosts = HostBindings(broker, self.job)
        run = _Run(broker, store, roster, outbox, desk, hosts, schedule)
        roster.sync()
        next_sweep = self._clock() + clients.heartbeat_s
        while not stop.is_set():
            delivery = broker.get(self._poll_s)
            if delivery is not None:
                self._handle(run, delivery)
            self._due_joins(run)
            if self._clock() >= next_sweep:
                # Asks about the members due to expire only: announces the expired ones.
                roster.sweep()
                next_sweep = self._clock() + clients.heartbeat_s

    def _handle(self, run: _Run, delivery: Delivery) -> None:
        try:
            message = decode(delivery.body)
        except DecodeError as exc:
            self._settle(run.broker, delivery, f"undecodable: {exc.reason}")
            return
        checks = self._checks
        if isinstance(message, Join):
            self._serve_one(run, delivery, message, checks.join, self._join)
        elif isinstance(message, Heartbeat):
            self._serve_one(run, delivery, message, checks.heartbeat, self._heartbeat)
        elif isinstance(message, HostHeartbeat):
            self._serve_one(run, delivery, message, checks.host_heartbeat, self._host_heartbeat)
        elif isinstance(message, Leave):
            self._serve_one(run, delivery, message, checks.leave, self._leave)
        else:
            refused = wrong_type(message, control_queue_name(self.job))
            self._settle(run.broker, delivery, refused.detail)

    def _serve_one(
        self,
        run: _Run,
        delivery: Delivery,
        message: M,
        checks: tuple[Check[M], ...],
        handler: Callable[[_Run, M], str | None],
    ) -> None:
        """`message`'s checks, then its handler, which returns None once the message is
        handled, else why to dead-letter it."""
        rejection = first_rejection(checks, delivery, message)
        if rejection is not None:
            self._settle(run.broker, delivery, rejection.detail)
            return
        with log_context(client=message.client):
            self._settle(run.broker, delivery, handler(run, message))

    def _join(self, run: _Run, message: Join) -> str | None:
        # Bound before anything is sent to the client: a Welcome, a refusal, a dismissal.
        reason = run.hosts.bind(message)
        if reason is not None:
            return reason
        outcome = run.desk.join(message)
        self.stats.joined += outcome == "new"
        self.stats.rejoined += outcome == "rejoined"
        self.stats.refused += outcome == "refused"
        self.stats.withheld += outcome == "withheld"
        if outcome == "too_soon":
            # A new process of the client (or its forger) a moment after a Welcome: answered
            # once the interval is over. Only the latest waits: an earlier one's session is
            # superseded by it, as a later Join supersedes any.
            due = self._clock() + run.desk.limit.interval_s
            superseded = run.deferred.get(message.client)
            run.deferred[message.client] = (due, message)
            self.stats.deferred += 1
            if superseded is not None:
                self._log.info(
                    "job %s: Join %s of client %s superseded by Join %s before its turn",
                    self.job,
                    superseded[1].message_id,
                    message.client,
                    message.message_id,
                )
            return None
        if outcome == "replayed":
            self.stats.replays += 1
            return run.desk.limit.replay_reason(message.client, message.message_id)
        if outcome == "unreachable":
            run.hosts.forget(message.client)
            return f"client {message.client} has no reply queue"
        return None

    def _due_joins(self, run: _Run) -> None:
        """Answer the deferred Joins whose interval is over (acked when deferred: a refusal
        now is only logged; the client's Join retry asks again)."""
        now = self._clock()
        for client, (due, message) in list(run.deferred.items()):
            if now < due:
                continue
            del run.deferred[client]
            with log_context(client=client):
                reason = self._join(run, message)
            if reason is not None:
                self._log.warning("job %s: deferred Join of %s: %s", self.job, client, reason)

    def _heartbeat(self, run: _Run, message: Heartbeat) -> str | None:
        if run.roster.renew([message.client])[0]:
            self.stats.heartbeats += 1
            return None
        self.stats.unknown_heartbeats += 1
        # An expired member rejoins when told; a stranger without a reply queue is not one.
        told = self._unknown(run, [message.client], message.message_id)
        return None if told else f"heartbeat of unknown client {message.client!r}"

    def _host_heartbeat(self, run: _Run, message: HostHeartbeat) -> None:
        """Each listed member renewed (one store step); the unknown ones told, as for a
        Heartbeat of theirs (routed to the host by their bindings). Always handled: one
        member without a reply queue is no reason to drop the others' renewals."""
        clients = list(message.members)
        live = run.roster.renew(clients)
        self.stats.host_heartbeats += 1
        self.stats.host_members += sum(live)
        unknown = [client for client, renewed in zip(clients, live, strict=True) if not renewed]
        self.stats.unknown_heartbeats += len(unknown)
        self._unknown(run, unknown, message.message_id)

    def _unknown(self, run: _Run, clients: Sequence[str], ref: str) -> bool:
        """Tell `clients` that they are no members; False if one has no reply queue."""
        if not clients:
            return True
        version = run.store.current_version(self.job)
        told = [
            run.outbox.error(c, version, "unknown_member", "unknown member, join first", ref)
            for c in clients
        ]
        return all(told)

    def _leave(self, run: _Run, message: Leave) -> str | None:
        info = run.roster.lookup(message.client)
        if info is None:
            self._log.info("job %s: leave from unknown client %s", self.job, message.client)
            return f"Leave of client {message.client!r}, who is not a member"
        run.roster.remove(message.client)
        run.desk.limit.forget(message.client)
        self.stats.left += 1
        version = run.store.current_version(self.job)
        event = MemberEvent("leave", info.client, open_round(version), info.partition, info.shard)
        run.schedule.add(event)
        run.schedule.flush()
        self._log.info("job %s: client %s left (%s)", self.job, message.client, message.reason)
        data = {"reason": message.reason or "leave"}
        run.outbox.event("member_left", version, data, message.client)
        return None

    def _announce_expired(
        self, store: WeightStore, outbox: Outbox, limit: WelcomeLimit, clients: Sequence[str]
    ) -> None:
        """Announce members whose heartbeats stopped (the store already dropped them)."""
        version = store.current_version(self.job)
        for client in clients:
            limit.forget(client)
            self.stats.expired += 1
            self._log.info("job %s: client %s expired", self.job, client)
            outbox.event("member_left", version, {"reason": "expired"}, client)

    def _record_drops(
        self, store: WeightStore, schedule: ScheduleLog, gone: Sequence[MemberInfo]
    ) -> None:
        """Record members that went silent (their records expired), written at once."""
        at = open_round(store.current_version(self.job))
        for info in gone:
            schedule.add(MemberEvent("drop", info.client, at, info.partition, info.shard))
        schedule.flush()

    def _settle(self, broker: Broker, delivery: Delivery, reason: str | None) -> None:
        """Ack a handled message; dead-letter one with a `reason`."""
        if reason is None:
            ack_safely(broker, delivery)
            return
        if dead_letter_safely(broker, delivery, reason) is Rejected.REDELIVERED:
            return  # its connection is gone: it comes back and is judged again
        self.stats.dead_lettered += 1
        self._log.warning("job %s: dead-lettering a control message: %s", self.job, reason)
