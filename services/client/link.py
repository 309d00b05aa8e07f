"""The client's broker handle: its reply queue in, publishes out; heartbeats on the side.

Everything a client does with the broker goes through a `ClientLink`, on the client's own
thread (a pika connection is not thread-safe). Membership heartbeats are the exception: they
go out from a thread and a handle of their own (`services.client.beat`), so that a long
training step cannot starve them. Every wait watches the stop event, so a stop interrupts the
client wherever it is blocked.
"""

from __future__ import annotations

import logging
import random
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from broker.codec import decode, encode
from broker.errors import BackPressureError, BrokerError, DecodeError, UnroutableError
from broker.messages import (
    Error,
    GradientReply,
    InferReply,
    Leave,
    Message,
    WeightsAssignment,
    Welcome,
    new_message_id,
)
from broker.rejection import Rejected, ack_safely, dead_letter_safely
from broker.topology import CONTROL_EXCHANGE, reply_queue, reply_queue_name
from broker.transport import Broker, Delivery
from services.client.beat import HeartbeatThread
from services.client.errors import ClientError, ClientStopped, RoundAborted
from services.client.stats import ClientStats

# What may arrive on a client's reply queue; anything else is dead-lettered.
REPLY_TYPES: tuple[type[Message], ...] = (
    Welcome,
    WeightsAssignment,
    GradientReply,
    Error,
    InferReply,
)
REPLY_PREFETCH = 16
# Longest single broker wait, so a stop is never held up for long.
MAX_POLL_S = 0.25

Check = Callable[[Message], str | None]


class RefusedMessage(RoundAborted):
    """A reply failed the caller's check; it was dead-lettered with this reason."""


@dataclass(frozen=True)
class Backoff:
    """Capped exponential backoff with jitter for refused publishes."""

    base_s: float = 0.05
    max_s: float = 2.0

    def delay(self, attempt: int, rng: random.Random) -> float:
        cap = min(self.max_s, self.base_s * 2.0 ** min(attempt, 30))
        # "Equal jitter": never less than half the cap, so retries stay spaced out, yet clients
        # refused together do not retry in lockstep.
        return cap / 2 + rng.uniform(0.0, cap / 2)


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
        heartbeat_s: float,
        backoff: Backoff,
        rng: random.Random,
        route_wait_s: float,
        logger: logging.Logger,
        open_beat_broker: Callable[[], Broker] | None = None,
    ) -> None:
        """`open_beat_broker` opens the heartbeat thread's own handle (`start_heartbeats`)."""
        self._broker = broker
        self.job = job
        self.client = client
        self._stats = stats
        self._stop = stop
        self._clock = clock
        self._heartbeat_s = heartbeat_s
        self._backoff = backoff
        self._rng = rng
        self._route_wait_s = route_wait_s
        self._log = logger
        self._deferred: deque[Message] = deque()
        self._validators: list[Check] = []
        self._open_beat_broker = open_beat_broker
        self._beat: HeartbeatThread | None = None  # None: not a member yet, no heartbeats
        self._next_keep_alive = 0.0
        # The latest weights version this client knows; the heartbeat thread reads it (an int
        # attribute: its reads and writes are atomic).
        self.version = 0
        self.io_s = 0.0  # time spent blocked on the broker (publishing, waiting, backing off)

    # --- set-up ---------------------------------------------------------------------------------

    def open(self) -> None:
        spec = reply_queue(self.job, self.client)
        self._broker.declare([spec])
        self._broker.subscribe(spec.name, prefetch=REPLY_PREFETCH)

    def validate_with(self, validator: Check) -> None:
        """Dead-letter every reply for which `validator` gives a reason (e.g. weights that do
        not fit the model, a GradientReply for a seq never sent), wherever it is received.
        Validators add up: each one added is asked, in order."""
        self._validators.append(validator)

    def start_heartbeats(self) -> None:
        """Start beating (once a member), every `heartbeat_s`, until `leave`."""
        if self._beat is not None:
            return
        if self._open_beat_broker is None:
            raise ValueError("this link has no heartbeat handle (open_beat_broker)")
        self._beat = HeartbeatThread(
            self._open_beat_broker,
            job=self.job,
            client=self.client,
            interval_s=self._heartbeat_s,
            version=lambda: self.version,
            logger=self._log,
        )
        self._beat.start()

    # --- publishing -----------------------------------------------------------------------------

    def send(self, exchange: str, routing_key: str, message: Message) -> bytes:
        """Encode and publish `message` (retrying while refused); returns the body sent."""
        body = encode(message)
        self.publish(exchange, routing_key, body, message_id=message.message_id)
        return body

    def publish(self, exchange: str, routing_key: str, body: bytes, *, message_id: str) -> None:
        """Publish, sleeping with backoff while the queue is full or not declared yet.

        A missing queue means the service side has not started (or declared) yet; after
        `route_wait_s` of that the client gives up with a `ClientError`.
        """
        attempt = 0
        unroutable_since: float | None = None
        while True:
            self._check_stop()
            started = self._clock()
            try:
                self._broker.publish(exchange, routing_key, body, message_id=message_id)
                self._stats.bytes_up += len(body)
                return
            except BackPressureError:
                self._stats.backpressure_retries += 1
                self._log.debug(
                    "%s: %s refused (queue full), backing off", self.client, routing_key
                )
            except UnroutableError as exc:
                self._stats.unroutable_retries += 1
                unroutable_since = started if unroutable_since is None else unroutable_since
                if started - unroutable_since >= self._route_wait_s:
                    raise ClientError(
                        f"job {self.job}, client {self.client}: nothing consumes {exchange} / "
                        f"{routing_key} after {self._route_wait_s:.0f} s ({exc}); is the "
                        "service side of the job running?"
                    ) from None
            finally:
                self.io_s += self._clock() - started
            self.sleep(self._backoff.delay(attempt, self._rng))
            attempt += 1

    def keep_alive(self) -> None:
        """Between local steps that never touch the broker (whole-model algorithms): every
        `heartbeat_s`, one cheap round trip on this handle, so that RabbitMQ does not drop an
        idle connection (AMQP heartbeats are only serviced while the handle is called)."""
        now = self._clock()
        if now < self._next_keep_alive:
            return
        self._next_keep_alive = now + self._heartbeat_s
        self._broker.queue_depth(reply_queue_name(self.job, self.client))

    def leave(self, reason: str) -> None:
        """Best effort: a client that cannot say goodbye is dropped by heartbeat expiry."""
        beat, self._beat = self._beat, None
        if beat is None:
            return
        # Heartbeats end first: one behind the Leave would find no member.
        if not beat.stop():
            self._log.warning("%s: heartbeat thread still publishing at leave", self.client)
        self._stats.heartbeats_sent += beat.sent
        self._stats.bytes_up += beat.bytes_sent
        message = Leave(self.job, self.client, new_message_id(), self.version, reason=reason)
        try:
            body = encode(message)
            self._broker.publish(CONTROL_EXCHANGE, self.job, body, message_id=message.message_id)
            self._stats.bytes_up += len(body)
        except BrokerError as exc:
            self._log.warning("%s: could not send Leave (%s): %s", self.client, reason, exc)

    # --- receiving ------------------------------------------------------------------------------

    def defer(self, message: Message) -> None:
        """Keep a reply for the main loop (e.g. an assignment that arrives mid-round)."""
        self._deferred.append(message)

    def poll(
        self, timeout: float, *, check: Check | None = None, deferred: bool = False
    ) -> Message | None:
        """The next valid reply within `timeout` seconds (deferred ones first when `deferred`).

        Invalid deliveries (undecodable, not for this client, refused by the validator) are
        dead-lettered and counted. One that fails this call's `check` is dead-lettered too,
        and raises `RefusedMessage`: the caller cannot go on without it.
        """
        if deferred and self._deferred:
            return self._deferred.popleft()
        started = self._clock()
        end = started + timeout
        try:
            while True:
                self._check_stop()
                wait = min(max(0.0, end - self._clock()), MAX_POLL_S)
                delivery = self._broker.get(wait)
                if delivery is not None:
                    message = self._accept(delivery, check)
                    if message is not None:
                        return message
                if self._clock() >= end:
                    return None
        finally:
            self.io_s += self._clock() - started

    def sleep(self, seconds: float) -> None:
        """Sleep; raises `ClientStopped` when stopped meanwhile."""
        started = self._clock()
        end = started + seconds
        try:
            while (left := end - self._clock()) > 0:
                if self._stop.wait(left):
                    raise ClientStopped("stop requested")
        finally:
            self.io_s += self._clock() - started

    def _accept(self, delivery: Delivery, check: Check | None) -> Message | None:
        self._stats.bytes_down += len(delivery.body)
        try:
            message = decode(delivery.body)
        except DecodeError as exc:
            self._refuse(delivery, f"undecodable: {exc.reason}")
            return None
        reason = self._envelope_problem(message)
        for validator in self._validators:
            if reason is not None:
                break
            reason = validator(message)
        if reason is not None:
            self._refuse(delivery, reason)
            return None
        reason = check(message) if check is not None else None
        if reason is not None:
            self._refuse(delivery, reason)
            raise RefusedMessage(reason)
        if not ack_safely(self._broker, delivery):
            return None  # its connection is gone: it comes back, and is taken then
        return message

    def _envelope_problem(self, message: Message) -> str | None:
        kind = type(message).__name__
        if not isinstance(message, REPLY_TYPES):
            return f"{kind} does not belong on a client's reply queue"
        if message.job != self.job:
            return f"{kind} for job {message.job!r} on a queue of job {self.job!r}"
        if message.client != self.client:
            return f"{kind} for client {message.client!r} on the queue of {self.client!r}"
        return None

    def _refuse(self, delivery: Delivery, reason: str) -> None:
        if dead_letter_safely(self._broker, delivery, reason) is Rejected.REDELIVERED:
            return  # its connection is gone: it comes back and is judged again
        self._stats.dead_lettered += 1
        self._log.warning(
            "job %s client %s: dead-lettering a reply: %s", self.job, self.client, reason
        )

    def _check_stop(self) -> None:
        if self._stop.is_set():
            raise ClientStopped("stop requested")
