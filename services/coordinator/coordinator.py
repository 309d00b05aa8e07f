"""The coordinator role: membership of one job (Join / Leave / Heartbeat / expiry; docs/
architecture.md, step 2). Membership lives in the store only, so a restarted coordinator, or
the aggregator reading cohorts, sees the same members.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from contextlib import closing
from dataclasses import dataclass

from broker.codec import decode
from broker.errors import DecodeError
from broker.messages import Heartbeat, Join, Leave, Message
from broker.rejection import Rejected, ack_safely, dead_letter_safely
from broker.store import WeightStore
from broker.topology import control_queue_name
from broker.transport import Broker, Delivery
from services.common.backends import Backends
from services.common.logs import log_context
from services.common.outbox import Outbox
from services.config.root import Settings
from services.coordinator.joining import JoinDesk
from services.coordinator.roster import Roster
from services.security.identity import client_id_problem, sender_check, service_user

_PREFETCH = 32


@dataclass
class CoordinatorStats:
    """Counters of one run (only the coordinator's thread writes them)."""

    joined: int = 0
    rejoined: int = 0
    refused: int = 0  # joins answered with an Error (job full)
    left: int = 0
    expired: int = 0
    heartbeats: int = 0
    unknown_heartbeats: int = 0
    dead_lettered: int = 0


class Coordinator:
    def __init__(
        self,
        settings: Settings,
        backends: Backends,
        *,
        clock: Callable[[], float] = time.monotonic,
        poll_s: float = 0.2,
    ) -> None:
        self._settings = settings
        self._backends = backends
        self._clock = clock
        self._log = logging.getLogger("splitmq.coordinator")
        self._poll_s = poll_s
        self.stats = CoordinatorStats()
        self._senders = sender_check(settings)

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
        roster = Roster(
            store,
            self.job,
            count=clients.count,
            ttl_s=clients.heartbeat_ttl_s,
            expired=lambda gone: self._announce_expired(store, outbox, gone),
            clock=self._clock,
        )
        desk = JoinDesk(self._settings, store, roster, outbox, self._log)
        roster.sync()
        next_sweep = self._clock() + clients.heartbeat_s
        while not stop.is_set():
            delivery = broker.get(self._poll_s)
            if delivery is not None:
                self._handle(broker, store, roster, outbox, desk, delivery)
            if self._clock() >= next_sweep:
                # The one read of all members per interval: announces the expired ones.
                roster.sync()
                next_sweep = self._clock() + clients.heartbeat_s

    def _handle(
        self,
        broker: Broker,
        store: WeightStore,
        roster: Roster,
        outbox: Outbox,
        desk: JoinDesk,
        delivery: Delivery,
    ) -> None:
        try:
            message = decode(delivery.body)
        except DecodeError as exc:
            self._settle(broker, delivery, f"undecodable: {exc.reason}")
            return
        reason = self._misaddressed(message, delivery)
        if reason is not None:
            self._settle(broker, delivery, reason)
            return
        with log_context(client=message.client):
            if isinstance(message, Join):
                outcome = desk.join(message)
                if outcome == "unreachable":
                    reason = f"client {message.client} has no reply queue"
                self.stats.joined += outcome == "new"
                self.stats.rejoined += outcome == "rejoined"
                self.stats.refused += outcome == "refused"
            elif isinstance(message, Heartbeat):
                reason = self._heartbeat(store, roster, outbox, message)
            elif isinstance(message, Leave):
                reason = self._leave(store, roster, outbox, message)
            self._settle(broker, delivery, reason)

    def _misaddressed(self, message: Message, delivery: Delivery) -> str | None:
        if not isinstance(message, Join | Heartbeat | Leave):
            return f"{type(message).__name__} does not belong on {control_queue_name(self.job)}"
        if message.job != self.job:
            return f"message for job {message.job!r} on job {self.job!r}'s control queue"
        if not message.client:
            return f"{type(message).__name__} without a client id"
        # Design §3: the broker vouches for user_id; the client field must not claim someone
        # else's identity (and in the secured mode a client message must carry one).
        sender = client_id_problem(message.client) or self._senders.client_problem(
            delivery, message.client
        )
        if sender is not None:
            return sender
        if isinstance(message, Heartbeat) and message.role != "client":
            return f"heartbeat of role {message.role!r}: only clients are members"
        return None

    def _heartbeat(
        self, store: WeightStore, roster: Roster, outbox: Outbox, message: Heartbeat
    ) -> str | None:
        """None once handled; the reason to dead-letter it otherwise."""
        if roster.renew([message.client])[0]:
            self.stats.heartbeats += 1
            return None
        self.stats.unknown_heartbeats += 1
        # An expired member rejoins when told; a stranger without a reply queue is not one.
        told = self._unknown(store, outbox, message.client, message.message_id)
        return None if told else f"heartbeat of unknown client {message.client!r}"

    def _unknown(self, store: WeightStore, outbox: Outbox, client: str, ref: str) -> bool:
        """Tell `client` that it is no member (False: it has no reply queue to be told)."""
        version = store.current_version(self.job)
        return outbox.error(client, version, "unknown_member", "unknown member, join first", ref)

    def _leave(
        self, store: WeightStore, roster: Roster, outbox: Outbox, message: Leave
    ) -> str | None:
        """None once handled; the reason to dead-letter it otherwise."""
        if roster.lookup(message.client) is None:
            self._log.info("job %s: leave from unknown client %s", self.job, message.client)
            return f"Leave of client {message.client!r}, who is not a member"
        roster.remove(message.client)
        self.stats.left += 1
        version = store.current_version(self.job)
        self._log.info("job %s: client %s left (%s)", self.job, message.client, message.reason)
        outbox.event("member_left", version, {"reason": message.reason or "leave"}, message.client)
        return None

    def _announce_expired(self, store: WeightStore, outbox: Outbox, clients: Sequence[str]) -> None:
        """Announce members whose heartbeats stopped (the store already dropped them)."""
        version = store.current_version(self.job)
        for client in clients:
            self.stats.expired += 1
            self._log.info("job %s: client %s expired", self.job, client)
            outbox.event("member_left", version, {"reason": "expired"}, client)

    def _settle(self, broker: Broker, delivery: Delivery, reason: str | None) -> None:
        """Ack a handled message; dead-letter one with a `reason`."""
        if reason is None:
            ack_safely(broker, delivery)
            return
        if dead_letter_safely(broker, delivery, reason) is Rejected.REDELIVERED:
            return  # its connection is gone: it comes back and is judged again
        self.stats.dead_lettered += 1
        self._log.warning("job %s: dead-lettering a control message: %s", self.job, reason)
