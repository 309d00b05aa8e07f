"""The RabbitMQ `Broker`: pika's BlockingConnection, one instance per thread.

Publishes are mandatory, confirmed and persistent (unless asked not to be); consumption is
pull-style over a local buffer that `get` fills by pumping the connection. A lost connection is
reopened on the next operation (see `broker.rabbitmq_channels`): topology and subscriptions come
back, a publish cut off before its confirm is sent again (at-least-once), and deliveries from
the lost connection become stale: acking one raises `StaleDeliveryError`, since RabbitMQ has
already requeued it.

`publish`, `get`, `ack` and `refused` run for every message: while the channels are open they
use them directly (the keeper's only on a first use, a loss or an error), so a message's path
crosses this file, `broker.rabbitmq_confirms` for a confirm_later publish, and the frames.
"""

from __future__ import annotations

import functools
import logging
import os
import random
import re
import time
import uuid
from collections import Counter, deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import pika
import pika.exceptions

from broker.errors import (
    BrokerError,
    StaleDeliveryError,
    UnroutableError,
)
from broker.rabbitmq_channels import ChannelKeeper
from broker.rabbitmq_connection import PIKA_ERRORS, RabbitMQOptions, connection_parameters
from broker.rabbitmq_consumers import Consumers
from broker.rabbitmq_declare import Declarations
from broker.topology import (
    BEST_EFFORT_EXCHANGES,
    CONTROL_EXCHANGE,
    DEAD_EXCHANGE,
    dead_queue,
    dead_queue_name,
)
from broker.transport import (
    PLAIN,
    Broker,
    Delivery,
    Meter,
    PublishOptions,
    QueueSpec,
    Refused,
    ServerInfo,
    check_publish,
    count_settled,
    dead_letter_headers,
    incoming_headers,
    no_dead_letter_routing,
    not_outstanding,
    outgoing_headers,
    unroutable,
)

__all__ = ["RabbitMQBroker", "RabbitMQOptions"]

_TRANSIENT, _PERSISTENT = 1, 2
_log = logging.getLogger("splitmq.broker")
Unsettled = list[tuple[Delivery, BrokerError]]


class RabbitMQBroker:
    """`broker.transport.Broker` over one RabbitMQ connection. Not thread-safe: one per thread.

    `url`: one node's, or a list of a cluster's nodes (any live one will do; see
    `ChannelKeeper`). Connects in the constructor (retrying as for any outage). `get` is also
    how the handle services heartbeats, so a consumer should call it (`get(0)` will do) at
    least every `options.heartbeat` seconds. `stamp` is the user_id of publishes that name none
    (RabbitMQ accepts only the connection's user); `meter` hears of every message sent,
    received and dead-lettered.
    """

    def __init__(
        self,
        url: str | Sequence[str],
        options: RabbitMQOptions | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
        rng: random.Random | None = None,
        stamp: str | None = None,
        meter: Meter | None = None,
    ) -> None:
        self._options = options or RabbitMQOptions()
        self.stamp = stamp
        self.meter = meter
        self._name = (
            self._options.connection_name or f"splitmq-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        )
        self._clock = clock
        self._buffer: deque[Delivery] = deque()  # received, not yet handed out by get()
        self._unacked: dict[int, str] = {}  # handed out, not yet settled: tag -> queue
        self._returned: set[int] = set()  # tags given back by unsubscribe
        urls = [url] if isinstance(url, str) else list(url)
        self._declared = Declarations(self._options)
        self._consumers = Consumers(on_message=self._on_message, on_void=self._void, clock=clock)
        self._keeper = ChannelKeeper(
            [connection_parameters(u, self._options, self._name) for u in urls],
            self._options,
            self._declared,
            self._consumers,
            clock=clock,
            sleep=sleep,
            rng=rng or random.Random(),
        )
        self._keeper.call(self._keeper.publisher, "connect")

    @property
    def connection_name(self) -> str:
        """The ``connection_name`` client property, to find this connection in rabbitmqctl."""
        return self._name

    @property
    def connects(self) -> int:
        """How many connections this handle has opened (1 + reconnects)."""
        return self._keeper.connects

    # -- Broker protocol ----------------------------------------------------------------------

    def declare(self, queues: Sequence[QueueSpec]) -> None:
        keeper = self._keeper
        names = ", ".join(spec.name for spec in queues) or "exchanges"
        try:
            keeper.call(
                lambda: self._declared.declare_on(keeper.publisher(), queues), f"declare {names}"
            )
        except BrokerError as exc:
            advice = _inequivalent_advice(exc.__cause__)
            if advice is None:
                raise
            raise BrokerError(f"{exc}; {advice}") from exc.__cause__

    def publish(
        self, exchange: str, routing_key: str, body: bytes, options: PublishOptions = PLAIN
    ) -> None:
        started = time.perf_counter()
        user_id = options.user_id or self.stamp
        target = f"exchange {exchange!r}, key {routing_key!r}"
        check_publish(body, self._options.max_message_bytes, user_id, self._keeper.user, target)
        properties = pika.BasicProperties(
            delivery_mode=_PERSISTENT if options.persistent else _TRANSIENT,
            headers=outgoing_headers(options.headers) if options.headers else None,
            message_id=options.message_id,
            user_id=user_id,
        )
        # The fast path: send on the channel as it stands while it is open (it is, but after a
        # loss or a channel error); else, or when that send fails (`failed`), the keeper opens
        # the channel or reconnects, and sends.
        keeper = self._keeper
        sent = False
        failed: BaseException | None = None
        if options.confirm_later:
            channel = keeper.later.channel
            if channel is not None and channel.is_open:
                try:
                    keeper.later.send(exchange, routing_key, body, properties, options)
                    sent = True
                except PIKA_ERRORS as exc:
                    failed = exc
            if not sent:
                keeper.send_later(exchange, routing_key, body, properties, options, failed)
        else:
            channel = keeper.publisher_channel
            if channel is not None and channel.is_open:
                mandatory = exchange not in BEST_EFFORT_EXCHANGES
                try:  # refusals mapped as in `ChannelKeeper.publish`
                    channel.basic_publish(
                        exchange, routing_key, body, properties, mandatory=mandatory
                    )
                    sent = True
                except pika.exceptions.NackError as exc:
                    raise self._declared.full(exchange, routing_key) from exc
                except pika.exceptions.UnroutableError as exc:
                    raise unroutable(exchange, routing_key) from exc
                except PIKA_ERRORS as exc:
                    failed = exc
            if not sent:
                keeper.publish(exchange, routing_key, body, properties, target, failed)
        if self.meter is not None:
            self.meter.sent(routing_key, len(body), time.perf_counter() - started)

    def refused(self) -> list[Refused]:
        """The confirm_later publishes refused since the last call, in publish order; takes in
        what RabbitMQ has sent meanwhile first (without waiting)."""
        keeper = self._keeper
        later, connection = keeper.later, keeper.connection
        if (later.sent or later.acked) and connection is not None and connection.is_open:
            try:
                connection.process_data_events(time_limit=0)
            except PIKA_ERRORS:
                keeper.drop_connection()  # the unconfirmed ones become refusals
        if not later.refusals:
            return []
        return [refusal for _, refusal in later.take()]

    def subscribe(self, queue: str, *, prefetch: int) -> None:
        if prefetch < 1:
            raise ValueError(f"prefetch must be at least 1, got {prefetch}")
        if not self._consumers.subscribed(queue):
            self._keeper.call(
                lambda: self._keeper.subscribe(queue, prefetch), f"subscribe to {queue!r}"
            )

    def unsubscribe(self, queue: str) -> None:
        if self._consumers.subscribed(queue):
            self._keeper.call(lambda: self._unsubscribe(queue), f"unsubscribe from {queue!r}")

    def get(self, timeout: float) -> Delivery | None:
        started = time.perf_counter()
        if not self._buffer:
            keeper, consumers = self._keeper, self._consumers
            deadline = self._clock() + timeout
            while True:
                remaining = max(0.0, deadline - self._clock())
                # The fast path: what `ChannelKeeper.pump` checks first holds (both channels
                # open, no subscription waiting to take a queue over), so pump the connection
                # here; else the keeper opens, looks, or reconnects (after `failed`), and pumps.
                channel, publisher = consumers.channel, keeper.publisher_channel
                pumped = False
                failed: BaseException | None = None
                if (
                    channel is not None
                    and channel.is_open
                    and publisher is not None
                    and publisher.is_open
                    and not consumers.waiting
                ):
                    try:
                        keeper.connection.process_data_events(time_limit=remaining)
                        pumped = True
                    except PIKA_ERRORS as exc:
                        failed = exc
                if not pumped:
                    keeper.call(functools.partial(keeper.pump, remaining), "receive", failed)
                if self._buffer or remaining <= 0.0:
                    break
        delivery = self._buffer.popleft() if self._buffer else None
        if delivery is not None:
            self._unacked[delivery.tag] = delivery.queue
        if self.meter is not None:
            size = 0 if delivery is None else len(delivery.body)
            self.meter.received(size, time.perf_counter() - started)
        return delivery

    def ack(self, delivery: Delivery) -> None:
        consumers = self._consumers
        channel = consumers.channel
        # `_outstanding`, inline for a delivery that can be settled (it raises for the others).
        if (
            channel is None
            or delivery.generation != consumers.generation
            or delivery.tag not in self._unacked
        ):
            channel = self._outstanding(delivery)
        try:
            channel.basic_ack(delivery.tag)
        except PIKA_ERRORS as exc:
            raise self._keeper.settle_failure(exc, delivery, "ack") from exc
        del self._unacked[delivery.tag]

    def nack(self, delivery: Delivery, *, requeue: bool) -> None:
        self._nack(delivery, requeue)
        if not requeue and self.meter is not None:
            self.meter.dead_lettered(None)

    def dead_letter(self, delivery: Delivery, reason: str) -> None:
        for _, error in self.dead_letter_many([(delivery, reason)]):
            raise error

    def _nack(self, delivery: Delivery, requeue: bool) -> None:
        channel = self._outstanding(delivery)
        try:
            channel.basic_nack(delivery.tag, requeue=requeue)
        except PIKA_ERRORS as exc:
            raise self._keeper.settle_failure(exc, delivery, "nack") from exc
        del self._unacked[delivery.tag]

    def dead_letter_many(self, letters: Sequence[tuple[Delivery, str]]) -> Unsettled:
        for delivery, _ in letters:  # a usage error raises before anything is settled
            self._outstanding(delivery, stale_passes=True)
        unsettled, ready = self._sort_letters(letters)
        by_nack = self._options.dead_letter_by_nack
        if by_nack:
            _log_by_nack([(delivery, reason) for delivery, reason, _ in ready])
        errors = {} if by_nack else self._copy_all(ready)
        for index, (delivery, _, _) in enumerate(ready):
            error = errors.get(index)
            if error is None:  # copied: a crash before the ack duplicates, never loses
                try:
                    if by_nack:
                        self._nack(delivery, False)
                    else:
                        self.ack(delivery)
                except BrokerError as exc:
                    error = exc
            if error is not None:
                unsettled.append((delivery, error))
        if self.meter is not None:
            count_settled(self.meter, letters, unsettled)
        return unsettled

    def _sort_letters(
        self, letters: Sequence[tuple[Delivery, str]]
    ) -> tuple[Unsettled, list[tuple[Delivery, str, str]]]:
        """The letters that cannot go (stale, no routing), and the others with their
        dead-letter routing key."""
        unsettled: Unsettled = []
        ready: list[tuple[Delivery, str, str]] = []
        for delivery, reason in letters:
            spec = self._declared.specs.get(delivery.queue)
            if spec is None or spec.dead_letter_routing_key is None:
                unsettled.append((delivery, no_dead_letter_routing(delivery)))
                continue
            try:
                self._outstanding(delivery)
            except StaleDeliveryError as exc:
                unsettled.append((delivery, exc))
                continue
            ready.append((delivery, reason, spec.dead_letter_routing_key))
        return unsettled, ready

    def _copy_all(self, letters: list[tuple[Delivery, str, str]]) -> dict[int, BrokerError]:
        """The letters' copies, all confirmed at once; the refused ones by index. Copies to a
        `<job>.dead` that was gone are sent once more after declaring it again."""
        if not letters:
            return {}
        copies = [(key, d.body, _dead_letter_properties(d, r)) for d, r, key in letters]
        refused = self._keeper.copy_all(copies, letters[0][0].generation)
        gone = [i for i, error in refused.items() if isinstance(error, UnroutableError)]
        for key in dict.fromkeys(letters[i][2] for i in gone):
            lost = [i for i in gone if letters[i][2] == key]
            refusal = self._restore_dead_queue(key)
            if refusal is not None:
                why = f"; declaring it again failed: {refusal}"
                refused.update({i: unroutable(DEAD_EXCHANGE, key, why) for i in lost})
                continue
            again = self._keeper.copy_all([copies[i] for i in lost], letters[0][0].generation)
            for at, i in enumerate(lost):
                if at in again:
                    refused[i] = again[at]
                else:
                    del refused[i]
        return refused

    def _restore_dead_queue(self, routing_key: str) -> str | None:
        """Declare the dead-letter queue for `routing_key` again (with the spec this handle
        declared, if any, so its limits match); why not, or None once it is back."""
        spec = self._declared.specs.get(dead_queue_name(routing_key)) or dead_queue(routing_key)
        if self._options.passive_declare:
            return f"this handle only checks queues (passive_declare), so {spec.name!r} stays gone"
        _log.warning(
            "dead-letter queue %s was gone; declaring it again (routing key %r)",
            spec.name,
            routing_key,
        )
        return self._keeper.try_declare([spec])

    def queue_depth(self, queue: str) -> int:
        def depth() -> int:
            ok = self._keeper.publisher().queue_declare(queue, passive=True)
            return int(ok.method.message_count)

        return self._keeper.call(depth, f"queue depth of {queue!r}")

    def delete_queue(self, queue: str) -> None:
        self.unsubscribe(queue)
        self._declared.forget(queue)
        self._keeper.call(
            lambda: self._keeper.publisher().queue_delete(queue), f"delete queue {queue!r}"
        )

    def close(self) -> None:
        if not self._keeper.closed:
            self._keeper.close()

    # -- extras -------------------------------------------------------------------------------

    def server_info(self) -> ServerInfo:
        """Who answers, and whether this handle can declare a queue and publish a message to it.

        Probes with an exclusive, auto-deleted queue it removes again; raises
        `BrokerUnavailableError` when RabbitMQ cannot be reached at all.
        """
        properties = self._keeper.server_properties()
        probe = QueueSpec(
            name=f"splitmq.probe.{uuid.uuid4().hex[:12]}",
            exchange=CONTROL_EXCHANGE,
            routing_key=f"splitmq.probe.{uuid.uuid4().hex[:12]}",
            durable=False,
            exclusive=True,
            auto_delete=True,
        )
        can_declare = can_publish = False
        detail = ""
        try:
            self.declare([probe])
            can_declare = True
            self.publish(CONTROL_EXCHANGE, probe.routing_key, b"splitmq doctor")
            can_publish = True
        except BrokerError as exc:
            detail = str(exc)
        finally:
            if can_declare:
                self.delete_queue(probe.name)
        return ServerInfo(
            product=_text(properties.get("product")),
            version=_text(properties.get("version")),
            can_declare=can_declare,
            can_publish=can_publish,
            max_message_bytes=self._options.max_message_bytes,
            detail=detail,
        )

    def __enter__(self) -> RabbitMQBroker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals ----------------------------------------------------------------------------

    def _unsubscribe(self, queue: str) -> None:
        spec = self._declared.specs.get(queue)
        held = any(d.queue == queue for d in self._buffer) or queue in self._unacked.values()
        if spec is not None and spec.single_active_consumer and held:
            # Cancelling first would let a successor take newer messages before these came
            # back (see ChannelKeeper._taken_over); closing the channel returns them as the
            # consumer goes.
            self._consumers.drop(queue)
            return
        if not self._consumers.stop(queue):
            return  # it was waiting to take the queue over: nothing of it was delivered
        if not self._consumers.cancel(self._keeper.consumer(), queue):
            return  # the channel was replaced meanwhile: nothing of this queue is outstanding
        channel = self._keeper.consumer()
        # basic.cancel leaves delivered messages unacked; give them back, as the protocol says.
        for delivery in [d for d in self._buffer if d.queue == queue]:
            channel.basic_nack(delivery.tag, requeue=True)
        kept = [d for d in self._buffer if d.queue != queue]
        self._buffer.clear()  # in place: `Consumers` appends to this very deque
        self._buffer.extend(kept)
        for tag, source in list(self._unacked.items()):
            if source == queue:
                channel.basic_nack(tag, requeue=True)
                del self._unacked[tag]
                self._returned.add(tag)

    def _on_message(
        self,
        generation: int,
        queue: str,
        _channel: Any,
        method: Any,
        properties: Any,
        body: bytes,
    ) -> None:
        """pika's delivery callback (`Consumers.consume` binds `generation` and `queue`)."""
        if generation != self._consumers.generation:
            return  # from a channel already given up; RabbitMQ has requeued it
        self._buffer.append(
            Delivery(
                body=body,
                queue=queue,
                routing_key=method.routing_key,
                tag=method.delivery_tag,
                redelivered=bool(method.redelivered),
                headers=incoming_headers(properties.headers) if properties.headers else {},
                message_id=properties.message_id,
                user_id=properties.user_id,
                generation=generation,
            )
        )

    def _void(self) -> None:
        """The consumer channel went: RabbitMQ requeued everything delivered on it."""
        self._buffer.clear()
        self._unacked.clear()
        self._returned.clear()

    def _outstanding(self, delivery: Delivery, *, stale_passes: bool = False) -> Any:
        """The consumer channel, if `delivery` can still be settled on it. `stale_passes`:
        raise only for a usage error (closed handle, a delivery never handed out or settled
        already); a stale delivery gives None, and keeps its mark."""
        if self._keeper.closed:
            raise BrokerError("this broker handle is closed")
        channel = self._consumers.live_channel(delivery.generation)
        if channel is None:
            if stale_passes:
                return None
            raise self._stale(delivery, "arrived on a channel that has since been lost")
        if delivery.tag not in self._unacked:
            if delivery.tag in self._returned:
                if stale_passes:
                    return None
                self._returned.discard(delivery.tag)
                raise self._stale(delivery, "was returned to its queue by unsubscribe")
            raise not_outstanding(delivery)
        return channel

    @staticmethod
    def _stale(delivery: Delivery, why: str) -> StaleDeliveryError:
        return StaleDeliveryError(
            f"delivery {delivery.tag} from {delivery.queue!r} {why}; "
            "RabbitMQ will redeliver the message"
        )


if TYPE_CHECKING:  # mypy proves the class satisfies the protocol

    def _conforms(broker: RabbitMQBroker) -> Broker:
        return broker


def _dead_letter_properties(delivery: Delivery, reason: str) -> Any:
    """The copy's properties: persistent, the original's headers and id, and ours."""
    headers = dead_letter_headers(delivery, reason)
    return pika.BasicProperties(
        delivery_mode=_PERSISTENT, headers=headers, message_id=delivery.message_id
    )


def _log_by_nack(letters: Sequence[tuple[Delivery, str]]) -> None:
    """One line for a batch dead-lettered by nack: its reasons are lost but for this line."""
    if not letters:
        return
    reasons = Counter(reason for _, reason in letters)
    _log.warning(
        "dead-lettering %d message(s) from %s by nack (no reason header): %s",
        len(letters),
        ", ".join(sorted({d.queue for d, _ in letters})),
        "; ".join(f"{r} (x{n})" if n > 1 else r for r, n in reasons.items()),
    )


def _inequivalent_advice(cause: BaseException | None) -> str | None:
    """How to mend a queue that exists with other arguments (an older SplitMQ's, or other
    limits): RabbitMQ never changes a declared queue's arguments."""
    if not isinstance(cause, pika.exceptions.ChannelClosedByBroker) or cause.reply_code != 406:
        return None
    text = str(cause.reply_text)
    found = re.search(r"for queue '([^']*)'", text)
    if "inequivalent arg" not in text or found is None:
        return None
    queue = found.group(1)
    if "x-queue-type" in text:
        return (
            f"queue {queue!r} exists as another queue type than broker.queue_type asks for "
            "(quorum is the default with more than one node); set queue_type to match, or "
            f"delete the queue (`rabbitmqctl delete_queue {queue}`, losing its messages) or "
            "start the job afresh with `splitmq up --fresh`"
        )
    return (
        f"queue {queue!r} exists with other arguments than this SplitMQ declares (made by an "
        f"older version or with other queue limits); delete it (`rabbitmqctl delete_queue "
        f"{queue}`, losing its messages) or start the job afresh with `splitmq up --fresh`"
    )


def _text(value: object) -> str:
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return "unknown" if value is None else str(value)
