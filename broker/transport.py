"""The `Broker` protocol: how every role moves bytes between processes.

A `Broker` instance belongs to one thread (pika is not thread-safe). Consumption is pull-style:
`subscribe` to queues, then `get` deliveries; this lets a worker drain several queued messages of
a shard into one batch without callbacks, and lets tests step a consumer deterministically.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

from broker.errors import BrokerError

# No float: pika cannot encode floats in an AMQP field table, so a float header would work with
# the in-memory broker and fail on RabbitMQ. Integers must fit in 64 signed bits.
HeaderValue = str | int | bool | bytes
Headers = Mapping[str, HeaderValue]

# Header names SplitMQ sets on dead-lettered messages.
REASON_HEADER = "x-splitmq-reason"
SOURCE_QUEUE_HEADER = "x-splitmq-queue"
# The original AMQP user_id of a dead-lettered message: the copy cannot keep the property because
# RabbitMQ only accepts a user_id equal to the publishing connection's user.
USER_HEADER = "x-splitmq-user"

# What a bounded queue does when full. reject-publish refuses the new message (a nack to the
# publisher: back-pressure, nothing silently lost); drop-head discards the oldest ready messages
# to make room, so publishing into the queue never fails.
Overflow = Literal["reject-publish", "drop-head"]

# RabbitMQ 3.x's default max_message_size (4.x: 16 MiB); brokers refuse larger bodies up front.
DEFAULT_MAX_MESSAGE_BYTES = 128 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class PublishOptions:
    """How one message is published, beyond where to and what."""

    message_id: str | None = None
    headers: Headers | None = None
    # The AMQP user the broker vouches for; None: the handle's stamp user, if it has one.
    user_id: str | None = None
    # False for messages worthless after a broker restart (a gradient for a step its client
    # will republish anyway): still confirmed, but kept in memory only, which spares RabbitMQ
    # a disk write and the publisher the wait for it.
    persistent: bool = True


PLAIN = PublishOptions()


class Meter(Protocol):
    """What a handle reports as it works, given where the broker is opened
    (`services.metrics.broker.BrokerMeter` feeds a role's recorder)."""

    def sent(self, routing_key: str, nbytes: int, seconds: float) -> None:
        """One message of `nbytes` published and confirmed, which took `seconds`."""
        ...

    def received(self, nbytes: int, waited_s: float) -> None:
        """`get` waited `waited_s` seconds and returned a message of `nbytes` (0: none)."""
        ...

    def dead_lettered(self, reason: str | None) -> None:
        """One message dead-lettered with `reason` (None: rejected by nack, no reason)."""
        ...


def count_settled(
    meter: Meter,
    letters: Sequence[tuple[Delivery, str]],
    unsettled: Sequence[tuple[Delivery, BrokerError]],
) -> None:
    """Tell `meter` of each letter of a `dead_letter_many` that is not among the unsettled."""
    left = {id(delivery) for delivery, _ in unsettled}
    for delivery, reason in letters:
        if id(delivery) not in left:
            meter.dead_lettered(reason)


@dataclass(frozen=True)
class QueueSpec:
    """A queue and its binding. Declaring it is idempotent; brokers re-declare on reconnect."""

    name: str
    exchange: str
    routing_key: str
    durable: bool = True
    single_active_consumer: bool = False
    max_length: int | None = None
    max_length_bytes: int | None = None
    # Only with a bound (max_length or max_length_bytes); both count ready messages only.
    overflow: Overflow = "reject-publish"
    # Where rejected messages go: routing key on the dead-letter exchange (None: not dead-lettered).
    dead_letter_routing_key: str | None = None
    exclusive: bool = False
    auto_delete: bool = False


@dataclass
class Delivery:
    """One received message. `tag` is opaque to callers; ack/nack go through the broker."""

    body: bytes
    queue: str
    routing_key: str
    tag: int
    redelivered: bool = False
    headers: Headers = field(default_factory=dict)
    message_id: str | None = None
    user_id: str | None = None
    # Which connection this came on; an ack on a lost connection is meaningless.
    generation: int = 0


@dataclass(frozen=True)
class ServerInfo:
    """What `splitmq doctor` reports about a broker: who answers and whether it works for us."""

    product: str
    version: str
    can_declare: bool
    can_publish: bool
    max_message_bytes: int
    # Why a check failed ("" when both passed).
    detail: str = ""


class Broker(Protocol):
    """Publish with confirm, consume with manual ack/nack, dead-letter with a reason, close."""

    def declare(self, queues: Sequence[QueueSpec]) -> None:
        """Declare SplitMQ's exchanges and the given queues with their bindings (idempotent)."""
        ...

    def publish(
        self, exchange: str, routing_key: str, body: bytes, options: PublishOptions = PLAIN
    ) -> None:
        """Publish mandatorily; return once the broker has confirmed it.

        Raises `BackPressureError` (queue full, nothing enqueued), `UnroutableError`,
        `MessageTooLargeError` or `BrokerUnavailableError`.
        """
        ...

    def subscribe(self, queue: str, *, prefetch: int) -> None:
        """Start receiving from `queue`, with at most `prefetch` unacknowledged deliveries."""
        ...

    def unsubscribe(self, queue: str) -> None:
        """Stop receiving from `queue`; deliveries not yet acked are returned to the queue."""
        ...

    def get(self, timeout: float) -> Delivery | None:
        """The next delivery from any subscribed queue, waiting at most `timeout` seconds."""
        ...

    def ack(self, delivery: Delivery) -> None:
        """Acknowledge; raises `StaleDeliveryError` if its connection has been lost meanwhile."""
        ...

    def nack(self, delivery: Delivery, *, requeue: bool) -> None:
        """Reject; with `requeue=False` the queue's dead-letter routing applies (no reason)."""
        ...

    def dead_letter(self, delivery: Delivery, reason: str) -> None:
        """Move a delivery to its queue's dead-letter queue with `reason` in a header."""
        ...

    def dead_letter_many(
        self, letters: Sequence[tuple[Delivery, str]]
    ) -> list[tuple[Delivery, BrokerError]]:
        """`dead_letter` for each (delivery, reason), waiting for the broker once for all the
        copies rather than once each (a flood's surplus: see `broker.rejection`).

        Returns the letters left unsettled, each with why: `StaleDeliveryError` (its
        connection was lost: the broker redelivers it; no copy was made where avoidable) or
        the refusal of its copy (`BackPressureError`, `UnroutableError`, a `BrokerError` such
        as no dead-letter routing on this handle). The others are copied, then settled: a
        crash in between duplicates, never loses. Raises only before settling anything: a
        closed handle, a delivery not outstanding on it.
        """
        ...

    def queue_depth(self, queue: str) -> int:
        """Messages ready in `queue` (not counting unacknowledged ones)."""
        ...

    def delete_queue(self, queue: str) -> None:
        """Delete a queue and its messages (operators and tests)."""
        ...

    def close(self) -> None:
        """Close the connection; unacked deliveries return to their queues."""
        ...
