"""One RabbitMQ connection and its channels, kept alive for a `RabbitMQBroker`.

The *publisher* channel (confirms on) carries declarations, publishes, queue depth and deletion;
the *consumer* channel carries subscriptions and acks. Two more channels, opened on first use,
publish without pika's wait for each confirm (`Unconfirmed`): `confirm_later` publishes, and
batched dead letters (`RabbitMQBroker.dead_letter_many`), whose N copies wait for their
confirms once.
A channel error (a bug, or a conflicting declaration) closes only the channel it happened on,
so a bad publish does not return the consumer's unacknowledged messages; a closed channel is
reopened on next use, once, never in a loop. A lost connection is reopened by `call` with
capped, jittered backoff; every new channel gets back what this handle declared and subscribed
to. An outage logs one warning when it begins and one info line when the connection is back,
never a line per attempt.

Whenever the consumer channel goes, everything delivered on it is void (RabbitMQ requeues it):
the generation is bumped and `on_void` tells the owner to drop its buffered and unacked state.
"""

from __future__ import annotations

import functools
import logging
import random
import ssl
import struct
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import pika
import pika.exceptions
import pika.frame
import pika.spec

from broker.errors import (
    BackPressureError,
    BrokerError,
    BrokerUnavailableError,
    StaleDeliveryError,
)
from broker.rabbitmq_connection import (
    AUTH_FAILURES,
    PIKA_ERRORS,
    Outage,
    RabbitMQOptions,
    auth_refused,
    describe,
    server_url,
)
from broker.topology import BEST_EFFORT_EXCHANGES, DEAD_EXCHANGE, EXCHANGES
from broker.transport import (
    PLAIN,
    Delivery,
    PublishOptions,
    QueueSpec,
    Refused,
    incoming_headers,
    unroutable,
)

T = TypeVar("T")
_log = logging.getLogger("splitmq.broker")
# How often a subscription waiting to take over a single-active-consumer queue looks again.
_LOOK_EVERY_S = 0.2


@dataclass(eq=False)
class _Sent:
    """A publish awaiting its confirm; `error` is set by a basic.return."""

    order: int  # across channels: confirms of one channel may come out of order, too
    exchange: str
    routing_key: str
    body: bytes
    options: PublishOptions
    error: BrokerError | None = None

    def refused(self, error: BrokerError) -> tuple[int, Refused]:
        return self.order, Refused(self.exchange, self.routing_key, self.body, self.options, error)


def queue_arguments(
    spec: QueueSpec, queue_type: str = "classic", delivery_limit: int = 20
) -> dict[str, Any]:
    """The x-arguments that give a declared queue the behaviour its spec asks for, as a
    `queue_type` queue (`RabbitMQOptions.queue_type`).

    A quorum queue must be durable and shared, so a private (exclusive or auto-delete) queue
    stays classic: it is gone with its connection anyway. A quorum queue that dead-letters does
    so at-least-once (RabbitMQ keeps the message until the dead-letter queue has confirmed it,
    so a node's death between the two loses nothing), which needs reject-publish overflow, and
    has a delivery limit, past which a message that kept coming back is dead-lettered.
    """
    args: dict[str, Any] = {}
    quorum = queue_type == "quorum" and spec.durable and not (spec.exclusive or spec.auto_delete)
    if quorum:
        args["x-queue-type"] = "quorum"
    if spec.single_active_consumer:
        args["x-single-active-consumer"] = True
    if spec.max_length is not None:
        args["x-max-length"] = spec.max_length
    if spec.max_length_bytes is not None:
        args["x-max-length-bytes"] = spec.max_length_bytes
    if spec.max_length is not None or spec.max_length_bytes is not None:
        args["x-overflow"] = spec.overflow
    if spec.dead_letter_routing_key is not None:
        args["x-dead-letter-exchange"] = DEAD_EXCHANGE
        args["x-dead-letter-routing-key"] = spec.dead_letter_routing_key
        if quorum:
            args["x-delivery-limit"] = delivery_limit
            if args.setdefault("x-overflow", "reject-publish") == "reject-publish":
                args["x-dead-letter-strategy"] = "at-least-once"
    return args


class Unconfirmed:
    """A confirm-mode channel nothing blocks on: each publish is noted by its delivery tag,
    confirms and basic.returns only take notes, and `take` hands out the refusals in publish
    order. RabbitMQ confirms out of order (an unroutable message at once, a full queue's nack
    later), so a refusal is held back until every earlier publish is confirmed."""

    def __init__(self, full: Callable[[str, str], BackPressureError]) -> None:
        self._full = full
        self.channel: Any = None
        self.sent: dict[int, _Sent] = {}  # by delivery tag, unconfirmed
        self._acked: deque[_Sent] = deque(maxlen=64)  # lately confirmed: a late basic.return
        self._next_tag = 1
        self._refused: list[tuple[int, Refused]] = []  # (order, refusal), not yet taken
        self._sends = 0  # publishes so far, for their order

    def waiting(self) -> bool:
        """Whether a confirm, or a late basic.return, may still come in."""
        return bool(self.sent or self._acked)

    def open(self, connection: Any) -> Any:
        channel = self.channel
        if channel is None or not channel.is_open:
            self.lose("its channel closed before the confirm")
            channel = connection.channel()
            # pika's BlockingChannel would wait for every confirm: confirms go to the
            # underlying channel, to callbacks that only take notes (nowait select).
            channel._impl.confirm_delivery(ack_nack_callback=self._on_confirm)
            channel._impl.add_on_return_callback(self._on_return)
            self.channel, self._next_tag = channel, 1
        return channel

    def send(
        self,
        exchange: str,
        routing_key: str,
        body: bytes,
        properties: Any,
        options: PublishOptions,
    ) -> int:
        """Write one publish on the open channel; its order, which `take` reports."""
        mandatory = exchange not in BEST_EFFORT_EXCHANGES
        # Noted first: writing the frames takes in what RabbitMQ sent meanwhile, and its
        # basic.return and confirm of this very message may be among it.
        tag, order = self._next_tag, self._sends
        self.sent[tag] = _Sent(order, exchange, routing_key, body, options)
        try:
            # Not in BlockingChannel's confirm mode, so this only writes the frames.
            self.channel.basic_publish(exchange, routing_key, body, properties, mandatory=mandatory)
        except BaseException:
            self.sent.pop(tag, None)
            raise
        self._next_tag += 1
        self._sends += 1
        return order

    def take(self) -> list[tuple[int, Refused]]:
        """The refusals since the last call, with their orders, in publish order."""
        taken = sorted(self._refused, key=lambda pair: pair[0])
        first_open = min((sent.order for sent in self.sent.values()), default=self._sends)
        self._refused = [pair for pair in taken if pair[0] > first_open]
        return [pair for pair in taken if pair[0] < first_open]

    def lose(self, why: str) -> None:
        """Every unconfirmed publish is refused, with `why` (the channel or connection went)."""
        for sent in self.sent.values():
            error = BrokerUnavailableError(f"publish to {sent.routing_key!r}: {why}")
            self._refused.append(sent.refused(sent.error or error))
        self.sent.clear()

    def _on_confirm(self, frame: Any) -> None:
        method = frame.method
        tags = [t for t in self.sent if t <= method.delivery_tag] if method.multiple else []
        for tag in tags or [method.delivery_tag]:
            sent = self.sent.pop(tag, None)
            if sent is None:
                continue
            if isinstance(method, pika.spec.Basic.Nack):
                sent.error = self._full(sent.exchange, sent.routing_key)
            if sent.error is not None:
                self._refused.append(sent.refused(sent.error))
            else:
                self._acked.append(sent)

    def _on_return(self, _channel: Any, method: Any, _props: Any, body: bytes) -> None:
        # A basic.return is sent before the confirm of the message it hands back, but now and
        # then it is read after it: then the message is among the lately confirmed.
        for sent in [*self.sent.values(), *self._acked]:
            if sent.error is None and sent.routing_key == method.routing_key and sent.body == body:
                sent.error = unroutable(sent.exchange, sent.routing_key)
                if sent in self._acked:
                    self._acked.remove(sent)
                    self._refused.append(sent.refused(sent.error))
                return


class ChannelKeeper:
    """The connection, its publisher and consumer channels, and what to restore on them.

    `nodes` are the parameters of one broker's nodes (one, or a cluster's): the connection
    goes to one of them, picked at random so that a pool of handles spreads over the cluster,
    and each time it is lost the next attempt goes to the next node, so a dead node costs one
    failed attempt, not an outage.
    """

    def __init__(
        self,
        nodes: Sequence[pika.URLParameters],
        options: RabbitMQOptions,
        *,
        on_delivery: Callable[[Delivery], None],
        on_void: Callable[[], None],
        clock: Callable[[], float],
        sleep: Callable[[float], None],
        rng: random.Random,
    ) -> None:
        if not nodes:
            raise ValueError("a RabbitMQ broker needs at least one node's URL")
        self._nodes = list(nodes)
        self._node = rng.randrange(len(self._nodes))
        self._options = options
        self._on_delivery = on_delivery
        self._on_void = on_void
        self._clock = clock
        self._sleep = sleep
        self._rng = rng
        self._connection: Any = None  # pika.BlockingConnection
        self._publisher_channel: Any = None  # pika BlockingChannel with confirms
        self._consumer_channel: Any = None
        self._later = Unconfirmed(self._full)  # confirm_later publishes
        self._dead = Unconfirmed(self._full)  # batched dead letters' copies
        self.connects = 0
        self.generation = 0  # carried by deliveries; bumped when older ones become void
        self.closed = False
        self._exchanges_declared = False
        self._specs: dict[str, QueueSpec] = {}
        self._prefetch: dict[str, int] = {}  # subscriptions to restore
        # Single-active-consumer subscriptions waiting for the queue's previous consumer to
        # go (`subscribe`), and when `pump` last looked.
        self._waiting: dict[str, int] = {}
        self._looked_at = 0.0
        self._consumer_tags: dict[str, str] = {}  # queue -> tag on the current consumer channel
        self._lost_at: float | None = None  # when the current outage began (None: connected)

    @property
    def specs(self) -> Mapping[str, QueueSpec]:
        """The queues declared through this handle, by name."""
        return self._specs

    @property
    def _params(self) -> pika.URLParameters:
        """The node connected to, or to be tried next."""
        return self._nodes[self._node]

    @property
    def user(self) -> str:
        name: str = self._params.credentials.username
        return name

    def server_properties(self) -> Mapping[str, object]:
        self.call(self.publisher, "connect")
        # pika keeps the server's Connection.Start properties on the underlying connection only.
        properties = getattr(self._connection._impl, "server_properties", None)
        return properties if isinstance(properties, dict) else {}

    def subscribed(self, queue: str) -> bool:
        return queue in self._prefetch or queue in self._waiting

    def live_consumer_channel(self, generation: int) -> Any:
        """The consumer channel, if deliveries of `generation` can still be settled on it."""
        if generation != self.generation or self._consumer_channel is None:
            return None
        return self._consumer_channel

    # -- running operations -------------------------------------------------------------------

    def call(self, op: Callable[[], T], what: str) -> T:
        """Run `op`, reconnecting on connection loss; map every pika error to ours."""
        outage: Outage | None = None
        while True:
            try:
                return op()
            except PIKA_ERRORS as exc:
                if not self._connection_lost(exc):
                    raise self.channel_failure(exc, what) from exc
                self._drop_connection()
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
                self._node = (self._node + 1) % len(self._nodes)
                outage.wait_or_give_up(exc, what)

    def publish(
        self, exchange: str, routing_key: str, body: bytes, properties: Any, target: str
    ) -> None:
        """Publish on the publisher channel and wait for the confirm; a refusal becomes our
        error. A connection lost before the confirm is reopened and the message sent again
        (at-least-once)."""
        mandatory = exchange not in BEST_EFFORT_EXCHANGES

        def send() -> None:
            try:
                channel = self.publisher()
                channel.basic_publish(exchange, routing_key, body, properties, mandatory=mandatory)
            except pika.exceptions.NackError as exc:
                raise self._full(exchange, routing_key) from exc
            except pika.exceptions.UnroutableError as exc:
                raise unroutable(exchange, routing_key) from exc

        self.call(send, f"publish to {target}")

    def _full(self, exchange: str, routing_key: str) -> BackPressureError:
        fanout = dict(EXCHANGES).get(exchange) == "fanout"
        names = [
            repr(spec.name)
            for spec in self._specs.values()
            if spec.exchange == exchange and (fanout or spec.routing_key == routing_key)
        ]
        return BackPressureError(
            f"RabbitMQ refused the message for exchange {exchange!r} key {routing_key!r}: "
            f"queue {', '.join(names) or '(not declared on this handle)'} is full "
            "(reject-publish); nothing was enqueued, retry later"
        )

    def send_later(
        self,
        exchange: str,
        routing_key: str,
        body: bytes,
        properties: Any,
        options: PublishOptions,
    ) -> None:
        """Publish without waiting for the confirm: `take_refused` reports a refusal later."""

        def send() -> None:
            self._open(self._later).send(exchange, routing_key, body, properties, options)

        self.call(send, f"publish to exchange {exchange!r}, key {routing_key!r}")

    def take_refused(self) -> list[Refused]:
        """The `send_later` publishes refused since the last call, in publish order; takes in
        what RabbitMQ has sent meanwhile first (without waiting)."""
        if self._later.waiting() and self._connection is not None and self._connection.is_open:
            try:
                self._connection.process_data_events(time_limit=0)
            except PIKA_ERRORS:
                self._drop_connection()  # the unconfirmed ones become refusals
        return [refusal for _, refusal in self._later.take()]

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
            if generation != self.generation:  # opening the channel reconnected
                return dict.fromkeys(range(len(copies)), stale)
            orders = {
                dead.send(DEAD_EXCHANGE, key, body, properties, PLAIN): index
                for index, (key, body, properties) in enumerate(copies)
            }
            channel = dead.channel

            def done() -> bool:
                return not dead.sent or not channel.is_open

            wait = getattr(self._connection, "_flush_output", None)
            if callable(wait):  # pika's own wait, as in its confirmed publish
                wait(done)
            while not done():  # a pika without it: poll, no slower than a confirm comes
                self._connection.process_data_events(time_limit=0.001)
        except PIKA_ERRORS as exc:
            if not self._connection_lost(exc):  # the channel was closed: nothing was lost
                failure = self.channel_failure(exc, "dead-letter copy")
                return dict.fromkeys(range(len(copies)), failure)
            self._drop_connection()
            self._note_lost(exc, "dead-letter copy")
            return dict.fromkeys(range(len(copies)), stale)
        if not channel.is_open:  # closed by RabbitMQ (say, no write permission)
            dead.lose("the dead-letter channel was closed by RabbitMQ")
        return {orders[o]: refusal.error for o, refusal in dead.take() if o in orders}

    def _open(self, unconfirmed: Unconfirmed) -> Unconfirmed:
        self.publisher()  # the connection, and the exchanges declared on it
        unconfirmed.open(self._connection)
        return unconfirmed

    def channel_failure(self, exc: BaseException, what: str) -> BrokerError:
        if self._publisher_channel is not None and not self._publisher_channel.is_open:
            self._publisher_channel = None
        if self._consumer_channel is not None and not self._consumer_channel.is_open:
            self._void_consumer()
        return BrokerError(f"{what} failed: {describe(exc)}")

    def settle_failure(self, exc: BaseException, delivery: Delivery, what: str) -> BrokerError:
        """Map a failed ack/nack/dead-letter: stale if its channel went, else a channel error."""
        if self._connection_lost(exc):
            self._drop_connection()
            self._note_lost(exc, what)
        elif self._consumer_channel is None or not self._consumer_channel.is_open:
            self._void_consumer()
        else:
            return self.channel_failure(exc, what)
        return StaleDeliveryError(
            f"{what} of delivery {delivery.tag} from {delivery.queue!r} failed: the channel "
            f"was lost ({describe(exc)}); RabbitMQ will redeliver the message"
        )

    # -- channels -------------------------------------------------------------------------

    def publisher(self) -> Any:
        connection = self._ensure_connection()
        channel = self._publisher_channel
        if channel is None or not channel.is_open:
            channel = connection.channel()
            channel.confirm_delivery()
            self._publisher_channel = channel
            if self._exchanges_declared:
                self._declare_exchanges(channel)
                self.declare_on(channel, list(self._specs.values()))
        return channel

    def consumer(self) -> Any:
        # Topology first: a re-subscription after a reconnect needs its queue to exist again.
        self.publisher()
        channel = self._consumer_channel
        if channel is None or not channel.is_open:
            self._void_consumer()
            channel = self._connection.channel()
            channel.add_on_cancel_callback(self._on_cancelled)
            self._consumer_channel = channel
            for queue, prefetch in list(self._prefetch.items()):
                try:
                    if self._taken_over(queue):  # our old consumer may linger a moment
                        del self._prefetch[queue]
                        self._waiting[queue] = prefetch
                    else:
                        self._consume(channel, queue, prefetch)
                except pika.exceptions.ChannelClosedByBroker:
                    del self._prefetch[queue]  # gone for good (deleted elsewhere): stop restoring
                    raise
        return channel

    def pump(self, time_limit: float) -> None:
        """Process I/O (deliveries, heartbeats) for at most `time_limit` seconds."""
        channel = self.consumer()
        if self._waiting and self._clock() - self._looked_at >= _LOOK_EVERY_S:
            self._looked_at = self._clock()
            for queue, prefetch in list(self._waiting.items()):
                if not self._taken_over(queue):
                    del self._waiting[queue]
                    self._consume(channel, queue, prefetch)
        if self._waiting:
            # Wake up for the next look, not only for I/O: nothing is delivered from a queue
            # not consumed yet, so a wait past the look would last its whole time limit.
            next_look = self._looked_at + _LOOK_EVERY_S - self._clock()
            time_limit = min(time_limit, max(0.0, next_look))
        self._connection.process_data_events(time_limit=time_limit)

    def _taken_over(self, queue: str) -> bool:
        """Whether `queue` has a single active consumer and someone consumes it now.

        A successor must not join while its predecessor is there: RabbitMQ makes a waiting
        consumer active the moment the active one is cancelled, and gives it newer messages
        before the ones the predecessor held come back (a quorum queue even when the
        predecessor's channel closes), while a worker applies a client's batches in the order
        of their seqs. Joining once the consumer count is 0, when the predecessor's messages
        are back at the head, keeps the queue's order across the take-over."""
        spec = self._specs.get(queue)
        if spec is None or not spec.single_active_consumer:
            return False
        ok = self.publisher().queue_declare(queue, passive=True)
        return int(ok.method.consumer_count) > 0

    def drop_consumer(self, queue: str) -> None:
        """Stop consuming `queue` by closing the consumer channel: RabbitMQ then gives back
        what the channel held and removes its consumers in one step, so a successor on a
        single-active-consumer queue finds the returned messages first. Everything delivered
        on the channel is void; the other subscriptions come back on the next channel."""
        self._prefetch.pop(queue, None)
        self._waiting.pop(queue, None)
        channel = self._consumer_channel
        self._void_consumer()
        if channel is not None and channel.is_open:
            _close_without_cancel(channel)

    def close(self) -> None:
        self.closed = True
        self._drop_connection()

    # -- topology and subscriptions -------------------------------------------------------

    def declare_on(self, channel: Any, specs: Sequence[QueueSpec]) -> None:
        # Exchanges once per channel: `publisher` re-declares them on every new channel.
        if not self._exchanges_declared:
            self._declare_exchanges(channel)
        if self._options.passive_declare:
            # Without configure permission: the queues must exist (and be bound) already. The
            # specs are still recorded, so dead_letter knows each queue's routing.
            for spec in specs:
                channel.queue_declare(spec.name, passive=True)
                self._specs[spec.name] = spec
            return
        for spec in specs:
            channel.queue_declare(
                spec.name,
                durable=spec.durable,
                exclusive=spec.exclusive,
                auto_delete=spec.auto_delete,
                arguments=queue_arguments(
                    spec, self._options.queue_type, self._options.delivery_limit
                )
                or None,
            )
            channel.queue_bind(spec.name, spec.exchange, routing_key=spec.routing_key)
            self._specs[spec.name] = spec

    def try_declare(self, specs: Sequence[QueueSpec]) -> str | None:
        """Declare `specs` on the publisher channel; RabbitMQ's refusal (a channel error such
        as ACCESS_REFUSED), or None when declared. A lost connection raises as from pika."""
        try:
            self.declare_on(self.publisher(), specs)
        except PIKA_ERRORS as exc:
            if self._connection_lost(exc):
                raise
            return str(self.channel_failure(exc, "declare " + ", ".join(s.name for s in specs)))
        return None

    def forget(self, queue: str) -> None:
        self._specs.pop(queue, None)

    def subscribe(self, queue: str, prefetch: int) -> None:
        """Consume `queue`; a single-active-consumer queue that someone else consumes is
        consumed once they have gone (`pump` looks, see `_taken_over`)."""
        # Check on the publisher channel first: a basic.consume on a missing queue would
        # close the consumer channel and void the other subscriptions' deliveries.
        self.publisher().queue_declare(queue, passive=True)
        if self._taken_over(queue):
            self._waiting[queue] = prefetch
            _log.info("waiting for the consumer of %s to go before taking it over", queue)
            return
        self._consume(self.consumer(), queue, prefetch)

    def cancel(self, queue: str) -> bool:
        """Stop consuming `queue`; True if a consumer on the current channel was cancelled."""
        self._prefetch.pop(queue, None)
        if self._waiting.pop(queue, None) is not None:
            return False  # never consumed
        channel = self.consumer()
        tag = self._consumer_tags.pop(queue, None)
        if tag is None:
            return False
        # pika requeues the deliveries that had not yet reached our callback.
        channel.basic_cancel(tag)
        return True

    def _declare_exchanges(self, channel: Any) -> None:
        passive = self._options.passive_declare
        for name, kind in EXCHANGES:
            channel.exchange_declare(name, kind, durable=True, passive=passive)
        self._exchanges_declared = True

    def _consume(self, channel: Any, queue: str, prefetch: int) -> None:
        # Per-consumer prefetch (global_qos=False): applies to the consumer created next.
        channel.basic_qos(prefetch_count=prefetch)
        on_message = functools.partial(self._on_message, self.generation, queue)
        self._consumer_tags[queue] = channel.basic_consume(queue, on_message, auto_ack=False)
        self._prefetch[queue] = prefetch  # restored on every new consumer channel

    def _on_message(
        self,
        generation: int,
        queue: str,
        _channel: Any,
        method: Any,
        properties: Any,
        body: bytes,
    ) -> None:
        if generation != self.generation:
            return  # from a channel already given up; RabbitMQ has requeued it
        self._on_delivery(
            Delivery(
                body=body,
                queue=queue,
                routing_key=method.routing_key,
                tag=method.delivery_tag,
                redelivered=bool(method.redelivered),
                headers=incoming_headers(properties.headers),
                message_id=properties.message_id,
                user_id=properties.user_id,
                generation=generation,
            )
        )

    def _on_cancelled(self, method_frame: Any) -> None:
        # RabbitMQ cancelled a consumer (its queue was deleted): do not restore it later.
        tag = method_frame.method.consumer_tag
        for queue, known in list(self._consumer_tags.items()):
            if known == tag:
                del self._consumer_tags[queue]
                self._prefetch.pop(queue, None)

    # -- connection -----------------------------------------------------------------------

    def _ensure_connection(self) -> Any:
        if self.closed:
            raise BrokerError("this broker handle is closed")
        if self._connection is None or not self._connection.is_open:
            self._drop_connection()
            self._connection = pika.BlockingConnection(self._params)
            tune_frames(self._connection)
            self.connects += 1
            if self._lost_at is not None:
                _log.info(
                    "%s RabbitMQ at %s after %.1f s",
                    "reconnected to" if self.connects > 1 else "connected to",
                    self._where(),
                    self._clock() - self._lost_at,
                )
                self._lost_at = None
        return self._connection

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
        return self._connection is None or not self._connection.is_open

    def _drop_connection(self) -> None:
        connection, self._connection = self._connection, None
        self._publisher_channel = self._later.channel = self._dead.channel = None
        self._later.lose("the connection was lost before the confirm")
        self._dead.lose("the connection was lost before the confirm")
        self._void_consumer()
        if connection is not None and connection.is_open:
            try:
                connection.close()
            except PIKA_ERRORS:
                pass  # abandoning it anyway; RabbitMQ requeues what it had delivered

    def _void_consumer(self) -> None:
        self._consumer_channel = None
        self._consumer_tags.clear()
        self.generation += 1
        self._on_void()


def _close_without_cancel(channel: Any) -> None:
    """Close a BlockingChannel as pika's `close` does, but without its basic.cancel of each
    consumer first (and nack of what pika had not yet handed out): that cancel is exactly
    the hand-over `ChannelKeeper.drop_consumer` must avoid. A pika whose internals differ gets
    its own close (then a successor may see the returned messages after newer ones)."""
    impl, flush, cleanup = (
        getattr(channel, n, None) for n in ("_impl", "_flush_output", "_cleanup")
    )
    if impl is None or not callable(flush) or not callable(cleanup):
        channel.close()
        return
    impl.close(reply_code=200, reply_text="Normal shutdown")
    try:
        flush(lambda: channel.is_closed)
    finally:
        cleanup()


# -- pika's frames --------------------------------------------------------------------------

_FRAME_HEAD = struct.Struct(">BHL")  # type, channel, payload size; the payload and 0xCE follow
_FRAME_END = bytes([pika.spec.FRAME_END])
# Bytes one `recv` may take in (pika's default: 4 KiB).
RECV_BYTES = 1 << 20


def tune_frames(connection: Any) -> bool:
    """Give an open pika connection a frame reader and writer that copy each body once; False
    if pika's internals differ from what this expects (then its own stay: only slower).

    pika 1.x reads the socket 4 KiB at a time into a `bytes` buffer it re-slices after every
    frame (`+=`, then `buffer[n:]`), and publishes by slicing the body into frames and joining
    each slice with its frame header: a 360 KiB body was copied ~5 times on receipt and twice
    on publish, a 16 MiB one ~130 times on receipt. Here a read of up to `RECV_BYTES` is
    parsed in place (body fragments are views into it, joined once by pika into the message
    body; only a frame cut by the end of a read is copied to complete it), and a publish is
    one buffer of all its frames, sent without further copies (docs/benchmarks.md, "SFL-V2
    throughput"). On a plain TCP connection, output is also sent at once (`_send_now`).
    """
    impl: Any = getattr(connection, "_impl", None)
    transport: Any = getattr(impl, "_transport", None)
    if not (
        isinstance(getattr(transport, "_MAX_RECV_BYTES", None), int)
        and isinstance(getattr(impl, "_frame_buffer", None), bytes)
        and isinstance(getattr(impl, "_body_max_length", None), int)
        and all(callable(getattr(impl, name, None)) for name in _PIKA_HOOKS)
    ):
        return False
    reader = _FrameReader(impl)
    impl._on_data_available = reader.feed
    impl._send_message = functools.partial(_send_message, impl)
    transport._MAX_RECV_BYTES = RECV_BYTES
    transport._MAX_CONSUME_BYTES = max(RECV_BYTES, transport._MAX_CONSUME_BYTES)
    plain = not isinstance(getattr(transport, "_sock", None), ssl.SSLSocket)
    if plain and all(hasattr(transport, name) for name in _TRANSPORT_STATE):
        transport.write = functools.partial(_send_now, transport, transport.write)
    return True


def _send_now(transport: Any, buffered: Callable[[Any], None], data: bytes | memoryview) -> None:
    """pika's transport `write`, which only buffers and has the ioloop wait until the socket
    is writable, with a `send` first when nothing waits before `data`: a publish or an ack
    then goes out without a poll of the ioloop. What the socket does not take is buffered as
    pika would (also on an error, which pika's own send then meets and handles)."""
    if transport._tx_buffers or transport._state != transport._STATE_ACTIVE:
        buffered(data)
        return
    try:
        sent = transport._sock.send(data)
    except OSError:  # would block, or an error: pika's own send meets it again
        sent = 0
    if sent < len(data):
        buffered(memoryview(data)[sent:])


_PIKA_HOOKS = ("_on_data_available", "_send_message", "_process_frame", "_adapter_emit_data")
_TRANSPORT_STATE = ("_sock", "_tx_buffers", "_state", "_STATE_ACTIVE", "write")


class _FrameReader:
    """pika's `Connection._on_data_available`, with frames parsed where they lie."""

    def __init__(self, impl: Any) -> None:
        self._impl = impl
        self._partial = bytearray(impl._frame_buffer)  # a frame cut by the end of a read
        impl._frame_buffer = b""

    def feed(self, data: bytes) -> None:
        start = 0
        partial = self._partial
        if partial:
            if len(partial) < _FRAME_HEAD.size:
                start = _FRAME_HEAD.size - len(partial)
                partial += data[:start]
                if len(partial) < _FRAME_HEAD.size:
                    return
            missing = _FRAME_HEAD.unpack_from(partial)[2] + 8 - len(partial)
            if missing > len(data) - start:
                partial += data[start:]
                return
            partial += data[start : start + missing]
            start += missing
            whole = bytes(partial)
            partial.clear()
            self._parse(whole, 0)
        self._parse(data, start)

    def _parse(self, data: bytes, offset: int) -> None:
        impl = self._impl
        view = memoryview(data)
        while len(data) - offset >= _FRAME_HEAD.size:
            kind, channel, size = _FRAME_HEAD.unpack_from(data, offset)
            end = offset + size + 8
            if end > len(data):
                break
            if data[end - 1] != pika.spec.FRAME_END:
                raise pika.exceptions.InvalidFrameError("Invalid FRAME_END marker")
            if kind == pika.spec.FRAME_BODY:
                value: Any = pika.frame.Body(channel, view[offset + 7 : end - 1])
            else:
                value = pika.frame.decode_frame(data[offset:end])[1]
            impl.bytes_received += end - offset  # pika's heartbeat checker watches it
            offset = end
            impl._process_frame(value)
        self._partial += view[offset:]


def _send_message(impl: Any, channel: int, method: Any, content: tuple[Any, bytes]) -> None:
    """pika's `Connection._send_message` (method, header and body frames), in one buffer."""
    properties, body = content
    pieces: list[bytes | memoryview] = [
        pika.frame.Method(channel, method).marshal(),
        pika.frame.Header(channel, len(body), properties).marshal(),
    ]
    limit = impl._body_max_length
    starts = range(0, len(body), limit)
    with memoryview(body) as view:
        for start in starts:
            chunk = view[start : start + limit]
            head = _FRAME_HEAD.pack(pika.spec.FRAME_BODY, channel, len(chunk))
            pieces += (head, chunk, _FRAME_END)
        data = b"".join(pieces)
    impl.bytes_sent += len(data)
    impl.frames_sent += 2 + len(starts)
    impl._adapter_emit_data(memoryview(data))  # a partial send re-queues a view, not a copy
