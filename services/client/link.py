"""The client's broker handle (`ClientLink`): publishes with back-off, receives replies.

Only the client's own thread calls a `ClientLink` (a pika connection is not thread-safe);
heartbeats have a thread and handle of their own (`services.client.beat`). Every wait watches
the stop event. Every delivery is judged once, in `ClientLink.poll` (docs/reliability.md, "Bad
input", the client rows: `ClientLink.problem`, with those of a Welcome, an assignment or a
U-shaped output in `services.client.replies`); replies are matched by seq. A round's batches
go through a `BrokerChannel` (services/client/channel.py) over this handle.
"""

from __future__ import annotations

import logging
import random
import threading
from collections import deque
from collections.abc import Callable

from broker.codec import decode, encode
from broker.errors import (
    BackPressureError,
    BrokerError,
    DecodeError,
    StaleDeliveryError,
    UnroutableError,
)
from broker.messages import (
    GradientReply,
    Leave,
    Message,
    ServerOutput,
    SmashedBatch,
    WeightsAssignment,
    Welcome,
    new_message_id,
)
from broker.rejection import Rejected, dead_letter_safely
from broker.topology import CONTROL_EXCHANGE
from broker.transport import Backoff, Broker, Delivery, PublishOptions, QueueSpec
from models.split import SplitNet
from services.client.beat import Heartbeats, StartBeats
from services.client.errors import ClientError, ClientStopped, RoundAborted
from services.client.plan import RoundPlan
from services.client.replies import REPLY_TYPES, fit_problem, output_problem
from services.client.stats import ClientStats
from services.client.tagged import Tagged

REPLY_PREFETCH = 16
# Longest single broker wait, so a stop is never held up for long.
MAX_POLL_S = 0.25
# For refused publishes. Equal jitter (never under half the cap): retries stay spaced out, yet
# clients refused together do not retry in lockstep.
_BACKOFF = Backoff(initial=0.05, cap=2.0)


class ClientLink:
    def __init__(
        self,
        broker: Broker,
        *,
        job: str,
        client: str,
        stats: ClientStats,
        stop: threading.Event,
        clock: Callable[[], float],
        logger: logging.Logger,
        heartbeat_s: float,
        route_wait_s: float = 60.0,
        rng: random.Random | None = None,
        reply_timeout_s: float = 30.0,
        max_republish: int = 5,
        seq_start: int | None = None,
        model: SplitNet,
        plan: RoundPlan,
        heartbeats: StartBeats | None = None,
        reply: QueueSpec | None = None,
    ) -> None:
        """`model` and `plan` (the client's own settings) judge Welcomes and assignments.
        `seq_start`: the session's first seq, if known before its Welcome (`begin`).
        `heartbeats` makes the member's heartbeats (`start_heartbeats`). `reply` is the
        client's own reply queue, declared and consumed by `open`; None for a client host's
        client, whose replies reach `broker` through the host's queue (docs/architecture.md,
        "Client hosts")."""
        self._broker = broker
        self.job = job
        self.client = client
        self.stats = stats
        self._stop = stop
        self.clock = clock
        self.log = Tagged(logger, job, client)
        self._heartbeat_s = heartbeat_s
        self._route_wait_s = route_wait_s
        self._rng = rng or random.Random()
        self.reply_timeout_s = reply_timeout_s
        self.max_republish = max_republish
        # The session's seqs run from its Welcome's `seq_base` on, one per batch, across
        # rounds: a reply at or past `next_seq` answers nothing sent, one below `seq_base` is a
        # previous process's. None before the Welcome: nothing is sent yet.
        self.seq_base = seq_start
        self.next_seq = seq_start or 0
        self.unawaited: set[int] = set()  # seqs sent without waiting (local-loss algorithms)
        self._model = model
        self._plan = plan
        self._heartbeats = heartbeats
        self._reply = reply
        self._deferred: deque[Message] = deque()
        self._beat: Heartbeats | None = None  # None: not a member yet, no heartbeats
        self._next_keep_alive = 0.0
        # The latest weights version this client knows; the heartbeat thread reads it (an int
        # attribute: its reads and writes are atomic).
        self.version = 0
        self.io_s = 0.0  # time spent blocked on the broker (publishing, waiting, backing off)

    # --- set-up ---------------------------------------------------------------------------------

    def open(self) -> None:
        if self._reply is not None:
            self._broker.declare([self._reply])
            self._broker.subscribe(self._reply.name, prefetch=REPLY_PREFETCH)

    def begin(self, seq_base: int) -> None:
        """Number the batches from a Welcome's `seq_base` on. Another Welcome of the session
        repeats its base; one after the member's record expired (answered `unknown_member`,
        joined again) brings a higher one, chosen above every seq sent, and the batches go on
        from there. A lower one (an older Welcome, late) changes nothing: seqs never go back."""
        if self.seq_base is None or seq_base > self.seq_base:
            self.seq_base = seq_base
            self.next_seq = max(self.next_seq, seq_base)

    def start_heartbeats(self) -> None:
        """Start beating (once a member) until `leave`."""
        if self._beat is not None:
            return
        if self._heartbeats is None:
            raise ValueError("this link has no heartbeats")
        self._beat = self._heartbeats(lambda: self.version)
        self._beat.start()

    # --- publishing -----------------------------------------------------------------------------

    def send(self, routing_key: str, message: Message) -> None:
        """Encode and publish `message` to the control exchange (retrying while refused)."""
        self.publish(CONTROL_EXCHANGE, routing_key, encode(message), message_id=message.message_id)

    def publish(self, exchange: str, routing_key: str, body: bytes, *, message_id: str) -> None:
        """Publish, sleeping with backoff while the queue is full or not declared yet (the
        service side has not started); after `route_wait_s` of that, a `ClientError`."""
        attempt = 0
        unroutable_since: float | None = None
        while True:
            if self._stop.is_set():
                raise ClientStopped("stop requested")
            started = self.clock()
            try:
                self._broker.publish(exchange, routing_key, body, PublishOptions(message_id))
                self.stats.bytes_up += len(body)
                return
            except BackPressureError:
                self.stats.backpressure_retries += 1
                self.log.debug("%s refused (queue full), backing off", routing_key)
            except UnroutableError as exc:
                self.stats.unroutable_retries += 1
                unroutable_since = started if unroutable_since is None else unroutable_since
                if started - unroutable_since >= self._route_wait_s:
                    raise ClientError(
                        f"job {self.job}, client {self.client}: nothing consumes {exchange} / "
                        f"{routing_key} after {self._route_wait_s:.0f} s ({exc}); is the "
                        "service side of the job running?"
                    ) from None
            finally:
                self.io_s += self.clock() - started
            started = self.clock()
            self._stop.wait(_BACKOFF.delay(attempt, self._rng))  # a stop raises at the top
            self.io_s += self.clock() - started
            attempt += 1

    def keep_alive(self) -> None:
        """Between local steps that never touch the broker (whole-model algorithms): every
        `heartbeat_s`, one cheap round trip on this handle, so that RabbitMQ does not drop an
        idle connection (AMQP heartbeats are only serviced while the handle is called)."""
        now = self.clock()
        if self._reply is None or now < self._next_keep_alive:
            return  # a client host keeps its own connections serviced
        self._next_keep_alive = now + self._heartbeat_s
        self._broker.queue_depth(self._reply.name)

    def leave(self, reason: str) -> None:
        """Best effort: a client that cannot say goodbye is dropped by heartbeat expiry."""
        beat, self._beat = self._beat, None
        if beat is None:
            return
        # Heartbeats end first: one behind the Leave would find no member.
        if not beat.stop():
            self.log.warning("heartbeat thread still publishing at leave")
        self.stats.heartbeats_sent += beat.sent
        self.stats.bytes_up += beat.bytes_sent
        message = Leave(self.job, self.client, new_message_id(), self.version, reason=reason)
        try:
            body = encode(message)
            options = PublishOptions(message.message_id)
            self._broker.publish(CONTROL_EXCHANGE, self.job, body, options)
            self.stats.bytes_up += len(body)
        except ClientStopped:
            pass  # a client host's client gone offline: it leaves no word, as a device would
        except BrokerError as exc:
            self.log.warning("could not send Leave (%s): %s", reason, exc)

    # --- receiving ------------------------------------------------------------------------------

    def defer(self, message: Message, *, first: bool = False) -> None:
        """Keep a reply for the main loop (e.g. an assignment that arrives mid-round)."""
        if first:
            self._deferred.appendleft(message)
        else:
            self._deferred.append(message)

    def poll(
        self, timeout: float, *, deferred: bool = False, awaiting: SmashedBatch | None = None
    ) -> Message | None:
        """The next valid reply within `timeout` seconds (deferred ones first when `deferred`);
        invalid ones are dead-lettered. An invalid answer to `awaiting` (ok, without a gradient
        of its batch's shape; a ServerOutput of the wrong shape) raises `RoundAborted`: the
        caller cannot go on without it."""
        if deferred and self._deferred:
            return self._deferred.popleft()
        started = self.clock()
        end = started + timeout
        try:
            while True:
                if self._stop.is_set():
                    raise ClientStopped("stop requested")
                delivery = self._broker.get(min(max(0.0, end - self.clock()), MAX_POLL_S))
                if delivery is not None:
                    # Judged here, in line: every batch's reply passes this way.
                    self.stats.bytes_down += len(delivery.body)
                    reason: str | None
                    try:
                        message = decode(delivery.body)
                    except DecodeError as exc:
                        reason, fatal = f"undecodable: {exc.reason}", False
                    else:
                        reason, fatal = self.problem(message, awaiting)
                    if reason is not None:
                        self._refuse(delivery, reason)
                        if fatal:  # the answer the caller waits for: it cannot go on
                            raise RoundAborted(reason)
                    else:
                        try:
                            self._broker.ack(delivery)
                            return message
                        except StaleDeliveryError:
                            pass  # its connection is gone: it comes back, and is taken then
                if self.clock() >= end:
                    return None
        finally:
            self.io_s += self.clock() - started

    def took_late(self, reply: GradientReply) -> bool:
        """Whether `reply` is a late answer to a batch sent without waiting (counted as a
        reply), else a duplicate (counted as dropped)."""
        if reply.seq in self.unawaited:
            self.unawaited.discard(reply.seq)
            self.stats.replies_received += 1
            return True
        self.stats.duplicates_dropped += 1
        return False

    def problem(self, message: Message, awaiting: SmashedBatch | None) -> tuple[str | None, bool]:
        """Why `message` cannot be taken on this client's reply queue (None: it can), and
        whether it is the answer to `awaiting` (the batch the caller waits for) that does not
        fit it. A Welcome or an assignment must fit the client's own plan and model."""
        kind = type(message).__name__
        if not isinstance(message, REPLY_TYPES):
            return f"{kind} does not belong on a client's reply queue", False
        if message.job != self.job:
            return f"{kind} for job {message.job!r} on a queue of job {self.job!r}", False
        if message.client != self.client:
            return f"{kind} for client {message.client!r} on the queue of {self.client!r}", False
        if isinstance(message, Welcome | WeightsAssignment):
            return fit_problem(message, self._plan, self._model), False
        if not isinstance(message, GradientReply | ServerOutput):
            return None, False
        # An earlier seq may be a late copy of an answer already taken, or a previous run's
        # (every one before the Welcome): a duplicate, not an invalid message.
        if self.seq_base is not None and message.seq >= self.next_seq:
            never = f"{kind} for seq {message.seq}, never sent by this client"
            return f"{never} (its next seq is {self.next_seq})", False
        if awaiting is None or message.seq != awaiting.seq:
            return None, False
        if isinstance(message, ServerOutput):
            return output_problem(message, awaiting, self._model), True
        shape, grad = awaiting.activations.shape, message.grad
        if message.status != "ok" or (grad is not None and grad.shape == shape):
            return None, False
        got = None if grad is None else list(grad.shape)
        return (
            f"GradientReply seq {message.seq}: gradient shape {got}, expected {list(shape)}",
            True,
        )

    def _refuse(self, delivery: Delivery, reason: str) -> None:
        if dead_letter_safely(self._broker, delivery, reason) is Rejected.REDELIVERED:
            return  # its connection is gone: it comes back and is judged again
        self.stats.dead_lettered += 1
        self.log.warning("dead-lettering a reply: %s", reason)
