"""One RabbitMQ connection and its channels, kept alive for a `RabbitMQBroker`.

The *publisher* channel (confirms on) carries declarations, publishes, queue depth and deletion;
the *consumer* channel (`broker.rabbitmq_consumers`) carries subscriptions and acks. Two more
channels, opened on first use, publish without pika's wait for each confirm
(`broker.rabbitmq_confirms.Unconfirmed`): `confirm_later` publishes, and batched dead letters
(`RabbitMQBroker.dead_letter_many`), whose N copies wait for their confirms once.
A channel error (a bug, or a conflicting declaration) closes only the channel it happened on,
so a bad publish does not return the consumer's unacknowledged messages; a closed channel is
reopened on next use, once, never in a loop. A lost connection is reopened by `call` with
capped, jittered backoff; every new channel gets back what this handle declared
(`broker.rabbitmq_declare`) and subscribed to. An outage logs one warning when it begins and
one info line when the connection is back, never a line per attempt. Each connection reads and
writes its frames through `broker.pika_frames`.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import pika
import pika.exceptions

from broker.errors import BrokerError, StaleDeliveryError
from broker.pika_frames import FramePatch
from broker.rabbitmq_confirms import Unconfirmed
from broker.rabbitmq_connection import (
    AUTH_FAILURES,
    PIKA_ERRORS,
    Outage,
    RabbitMQOptions,
    auth_refused,
    describe,
    server_url,
)
from broker.rabbitmq_consumers import Consumers
from broker.rabbitmq_declare import Declarations
from broker.topology import BEST_EFFORT_EXCHANGES, DEAD_EXCHANGE
from broker.transport import PLAIN, Delivery, PublishOptions, QueueSpec, unroutable

__all__ = ["ChannelKeeper"]

T = TypeVar("T")
_log = logging.getLogger("splitmq.broker")


class ChannelKeeper:
    """The connection, its publisher channel, the consumer channel kept by `consumers`, and
    what to restore on them (`declared`, `consumers`).

    `nodes` are the parameters of one broker's nodes (one, or a cluster's): the connection
    goes to one of them, picked at random so that a pool of handles spreads over the cluster,
    and each time it is lost the next attempt goes to the next node, so a dead node costs one
    failed attempt, not an outage.
    """

    def __init__(
        self,
        nodes: Sequence[pika.URLParameters],
        options: RabbitMQOptions,
        declared: Declarations,
        consumers: Consumers,
        *,
        clock: Callable[[], float],
        sleep: Callable[[float], None],
        rng: random.Random,
    ) -> None:
        if not nodes:
            raise ValueError("a RabbitMQ broker needs at least one node's URL")
        self._nodes = list(nodes)
        self._next_node(rng.randrange(len(self._nodes)))
        self._options = options
        self._declared = declared
        self._consumers = consumers
        self._clock = clock
        self._sleep = sleep
        self._rng = rng
        self._frames = FramePatch()
        # `RabbitMQBroker`'s per-message methods use these as they are while open (the fast
        # path), and come here (`call`) to open or reopen them.
        self.connection: Any = None  # pika.BlockingConnection
        self.publisher_channel: Any = None  # pika BlockingChannel with confirms
        self.later = Unconfirmed(declared.full)  # confirm_later publishes
        self._dead = Unconfirmed(declared.full)  # batched dead letters' copies
        self.connects = 0
        self.closed = False
        self._lost_at: float | None = None  # when the current outage began (None: connected)

    def _next_node(self, node: int) -> None:
        """Make `node` the one connected to, or tried next: `_params`, and its `user`, which
        every publish checks its user_id against (kept, not looked up per publish)."""
        self._node: int = node % len(self._nodes)
        self._params: pika.URLParameters = self._nodes[self._node]
        self.user: str = str(self._params.credentials.username)

    def server_properties(self) -> Mapping[str, object]:
        self.call(self.publisher, "connect")
        # pika keeps the server's Connection.Start properties on the underlying connection only.
        properties = getattr(self.connection._impl, "server_properties", None)
        return properties if isinstance(properties, dict) else {}

    # -- running operations -------------------------------------------------------------------

    def call(self, op: Callable[[], T], what: str, failed: BaseException | None = None) -> T:
        """Run `op`, reconnecting on connection loss; map every pika error to ours. `failed`:
        the pika error a first attempt made outside (a fast path), handled as if `op` had
        raised it."""
        outage: Outage | None = None
        while True:
            exc = failed
            if exc is None:
                try:
                    return op()
                except PIKA_ERRORS as raised:
                    exc = raised
            failed = None
            if not self._connection_lost(exc):
                raise self.channel_failure(exc, what) from exc
            self.drop_connection()
            if isinstance(exc, AUTH_FAILURES):
                raise auth_refused(exc, what, self._params) from exc
            if outage is None:
                where = ", ".join(server_url(node) for node in self._nodes)
                outage = Outage(
                    self._options,
                    clock=self._clock,
                    sleep=self._sleep,
                    rng=self._rng,
                    where=where if len(self._nodes) == 1 else f"any of {where}",
                )
                self._note_lost(exc, what)
            self._next_node(self._node + 1)
            outage.wait_or_give_up(exc, what)

    def publish(
        self,
        exchange: str,
        routing_key: str,
        body: bytes,
        properties: Any,
        target: str,
        failed: BaseException | None = None,
    ) -> None:
        """Publish on the publisher channel and wait for the confirm; a refusal becomes our
        error. A connection lost before the confirm is reopened and the message sent again
        (at-least-once). `failed`: as for `call` (`RabbitMQBroker.publish` tries the open
        channel first, with the same mapping of a refusal)."""
        mandatory = exchange not in BEST_EFFORT_EXCHANGES

        def send() -> None:
            try:
                channel = self.publisher()
                channel.basic_publish(exchange, routing_key, body, properties, mandatory=mandatory)
            except pika.exceptions.NackError as exc:
                raise self._declared.full(exchange, routing_key) from exc
            except pika.exceptions.UnroutableError as exc:
                raise unroutable(exchange, routing_key) from exc

        self.call(send, f"publish to {target}", failed)

    def send_later(
        self,
        exchange: str,
        routing_key: str,
        body: bytes,
        properties: Any,
        options: PublishOptions,
        failed: BaseException | None = None,
    ) -> None:
        """Publish without waiting for the confirm: `RabbitMQBroker.refused` reports a refusal
        later (from `later`). `failed`: as for `call`."""

        def send() -> None:
            self._open(self.later).send(exchange, routing_key, body, properties, options)

        self.call(send, f"publish to exchange {exchange!r}, key {routing_key!r}", failed)

    def copy_all(
        self, copies: Sequence[tuple[str, bytes, Any]], generation: int
    ) -> dict[int, BrokerError]:
        """Publish each (routing key, body, properties) to the dead-letter exchange and wait
        for all their confirms at once; the refused ones by index. On a lost connection, or
        once deliveries of `generation` are void, nothing is sent (again): RabbitMQ requeues
        the originals, and a copy that landed is a duplicate, never a loss."""
        dead = self._dead
        stale = StaleDeliveryError(
            "dead-letter copy: the connection was lost; RabbitMQ will redeliver the messages"
        )
        try:
            self._open(dead)
            if generation != self._consumers.generation:  # opening the channel reconnected
                return dict.fromkeys(range(len(copies)), stale)
            orders = {
                dead.send(DEAD_EXCHANGE, key, body, properties, PLAIN): index
                for index, (key, body, properties) in enumerate(copies)
            }
            channel = dead.channel

            def done() -> bool:
                return not dead.sent or not channel.is_open

            wait = getattr(self.connection, "_flush_output", None)
            if callable(wait):  # pika's own wait, as in its confirmed publish
                wait(done)
            while not done():  # a pika without it: poll, no slower than a confirm comes
                self.connection.process_data_events(time_limit=0.001)
        except PIKA_ERRORS as exc:
            if not self._connection_lost(exc):  # the channel was closed: nothing was lost
                failure = self.channel_failure(exc, "dead-letter copy")
                return dict.fromkeys(range(len(copies)), failure)
            self.drop_connection()
            self._note_lost(exc, "dead-letter copy")
            return dict.fromkeys(range(len(copies)), stale)
        if not channel.is_open:  # closed by RabbitMQ (say, no write permission)
            dead.lose("the dead-letter channel was closed by RabbitMQ")
        return {orders[o]: refusal.error for o, refusal in dead.take() if o in orders}

    def _open(self, unconfirmed: Unconfirmed) -> Unconfirmed:
        self.publisher()  # the connection, and the exchanges declared on it
        unconfirmed.open(self.connection)
        return unconfirmed

    def channel_failure(self, exc: BaseException, what: str) -> BrokerError:
        if self.publisher_channel is not None and not self.publisher_channel.is_open:
            self.publisher_channel = None
        consumer = self._consumers.channel
        if consumer is not None and not consumer.is_open:
            self._consumers.void()
        return BrokerError(f"{what} failed: {describe(exc)}")

    def settle_failure(self, exc: BaseException, delivery: Delivery, what: str) -> BrokerError:
        """Map a failed ack/nack/dead-letter: stale if its channel went, else a channel error."""
        if self._connection_lost(exc):
            self.drop_connection()
            self._note_lost(exc, what)
        elif self._consumers.channel is None or not self._consumers.channel.is_open:
            self._consumers.void()
        else:
            return self.channel_failure(exc, what)
        return StaleDeliveryError(
            f"{what} of delivery {delivery.tag} from {delivery.queue!r} failed: the channel "
            f"was lost ({describe(exc)}); RabbitMQ will redeliver the message"
        )

    # -- channels -------------------------------------------------------------------------

    def publisher(self) -> Any:
        connection = self._ensure_connection()
        channel = self.publisher_channel
        if channel is None or not channel.is_open:
            channel = connection.channel()
            channel.confirm_delivery()
            self.publisher_channel = channel
            self._declared.restore(channel)
        return channel

    def consumer(self) -> Any:
        # Topology first: a re-subscription after a reconnect needs its queue to exist again.
        self.publisher()
        return self._consumers.open(self.connection, self._taken_over)

    def pump(self, time_limit: float) -> None:
        """Process I/O (deliveries, heartbeats) for at most `time_limit` seconds."""
        channel = self.consumer()
        time_limit = self._consumers.look(channel, self._taken_over, time_limit)
        self.connection.process_data_events(time_limit=time_limit)

    def subscribe(self, queue: str, prefetch: int) -> None:
        """Consume `queue`; a single-active-consumer queue that someone else consumes is
        consumed once they have gone (`pump` looks, see `_taken_over`)."""
        # Check on the publisher channel first: a basic.consume on a missing queue would
        # close the consumer channel and void the other subscriptions' deliveries.
        self.publisher().queue_declare(queue, passive=True)
        if self._taken_over(queue):
            self._consumers.wait(queue, prefetch)
            return
        self._consumers.consume(self.consumer(), queue, prefetch)

    def _taken_over(self, queue: str) -> bool:
        """Whether `queue` has a single active consumer and someone consumes it now.

        A successor must not join while its predecessor is there: RabbitMQ makes a waiting
        consumer active the moment the active one is cancelled, and gives it newer messages
        before the ones the predecessor held come back (a quorum queue even when the
        predecessor's channel closes), while a worker applies a client's batches in the order
        of their seqs. Joining once the consumer count is 0, when the predecessor's messages
        are back at the head, keeps the queue's order across the take-over."""
        spec = self._declared.specs.get(queue)
        if spec is None or not spec.single_active_consumer:
            return False
        ok = self.publisher().queue_declare(queue, passive=True)
        return int(ok.method.consumer_count) > 0

    def try_declare(self, specs: Sequence[QueueSpec]) -> str | None:
        """Declare `specs` on the publisher channel; RabbitMQ's refusal (a channel error such
        as ACCESS_REFUSED), or None when declared. A lost connection raises as from pika."""
        try:
            self._declared.declare_on(self.publisher(), specs)
        except PIKA_ERRORS as exc:
            if self._connection_lost(exc):
                raise
            return str(self.channel_failure(exc, "declare " + ", ".join(s.name for s in specs)))
        return None

    # -- connection -----------------------------------------------------------------------

    def close(self) -> None:
        self.closed = True
        self.drop_connection()

    def _ensure_connection(self) -> Any:
        if self.closed:
            raise BrokerError("this broker handle is closed")
        if self.connection is None or not self.connection.is_open:
            self.drop_connection()
            self.connection = pika.BlockingConnection(self._params)
            self._frames.apply(self.connection)
            self.connects += 1
            if self._lost_at is not None:
                _log.info(
                    "%s RabbitMQ at %s after %.1f s",
                    "reconnected to" if self.connects > 1 else "connected to",
                    self._where(),
                    self._clock() - self._lost_at,
                )
                self._lost_at = None
        return self.connection

    def _note_lost(self, exc: BaseException, what: str) -> None:
        """One warning per outage, however many attempts it takes (no traceback: the cause is
        a network or server event, not a bug); `_ensure_connection` says when it is over."""
        if self._lost_at is not None:
            return
        self._lost_at = self._clock()
        if self.connects:
            lost = f"lost the connection to RabbitMQ at {self._where()}"
        else:
            lost = f"cannot reach RabbitMQ at {self._where()}"
        _log.warning(
            "%s (%s, during %s); retrying for up to %.0f s",
            lost,
            describe(exc),
            what,
            self._options.give_up_after,
        )

    def _where(self) -> str:
        vhost = self._params.virtual_host
        suffix = "" if vhost == "/" else f" (vhost {vhost!r})"
        return f"{self._params.host}:{self._params.port}{suffix}"

    def _connection_lost(self, exc: BaseException) -> bool:
        if isinstance(exc, pika.exceptions.AMQPConnectionError):
            return True
        return self.connection is None or not self.connection.is_open

    def drop_connection(self) -> None:
        connection, self.connection = self.connection, None
        self.publisher_channel = self.later.channel = self._dead.channel = None
        self.later.lose("the connection was lost before the confirm")
        self._dead.lose("the connection was lost before the confirm")
        self._consumers.void()
        if connection is not None and connection.is_open:
            try:
                connection.close()
            except PIKA_ERRORS:
                pass  # abandoning it anyway; RabbitMQ requeues what it had delivered
