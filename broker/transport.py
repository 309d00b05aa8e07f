"""The `Broker` protocol: how every role moves bytes between processes.

A `Broker` instance belongs to one thread (pika is not thread-safe). Consumption is pull-style:
`subscribe` to queues, then `get` deliveries; this lets a worker drain several queued messages of
a shard into one batch without callbacks, and lets tests step a consumer deterministically.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

from broker.errors import BrokerError, EncodeError, MessageTooLargeError, UnroutableError

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


# What both brokers check before a publish, so that one the in-memory broker accepts never fails
# later on RabbitMQ: AMQP field-table keys are short strings (at most 255 bytes) and pika
# encodes only str, bytes, bool and 64-bit int among our `HeaderValue` types.
_INT64_MIN = -(1 << 63)
_INT64_MAX = (1 << 63) - 1
_MAX_KEY_BYTES = 255


def check_publish(
    body: object, max_bytes: int, user_id: str | None, user: str | None, target: str
) -> None:
    """Refuse up front what the broker would refuse later (`target` names exchange and key):
    RabbitMQ answers an oversize body, or a user_id that is not the connection's `user`, by
    closing the channel."""
    if not isinstance(body, bytes):
        # The in-memory queue keeps a reference (a mutable buffer could change after the
        # publish); pika 1.4 turns any non-bytes body into bytes with str.encode.
        raise TypeError(f"body must be bytes, not {type(body).__name__}")
    if len(body) > max_bytes:
        raise MessageTooLargeError(
            f"body of {len(body)} bytes exceeds the broker's max_message_size of {max_bytes} "
            f"bytes ({target}); split the payload or raise the server limit"
        )
    if user_id is not None and user is not None and user_id != user:
        raise BrokerError(f"user_id {user_id!r} differs from this connection's user {user!r}")


def outgoing_headers(headers: Headers | None) -> dict[str, HeaderValue] | None:
    """A checked copy of `headers` (None when empty); raises `EncodeError` on a bad entry."""
    if not headers:
        return None
    checked: dict[str, HeaderValue] = {}
    for key, value in headers.items():
        if not isinstance(key, str) or len(key.encode()) > _MAX_KEY_BYTES:
            raise EncodeError(f"header key {key!r} must be a str of at most 255 UTF-8 bytes")
        # bool is an int subclass; test it first so True is not range-checked as 1.
        if isinstance(value, bool | str | bytes):
            pass
        elif isinstance(value, int):
            if not _INT64_MIN <= value <= _INT64_MAX:
                raise EncodeError(f"header {key!r}: integer {value} does not fit in 64 bits")
        else:
            raise EncodeError(
                f"header {key!r}: unsupported type {type(value).__name__} (str, bytes, bool, int)"
            )
        checked[key] = value
    return checked


def incoming_headers(raw: Mapping[str, object] | None) -> dict[str, HeaderValue]:
    """The scalar entries of a received table.

    Tables, arrays, timestamps and decimals (RabbitMQ's ``x-death`` history, for one) are dropped:
    callers see only `HeaderValue`s. RabbitMQ's scalar ``x-first-death-*`` headers survive.
    """
    if not raw:
        return {}
    kept: dict[str, HeaderValue] = {}
    for key, value in raw.items():
        if isinstance(value, bool | str | bytes):
            kept[key] = value
        elif isinstance(value, int):
            # pika decodes 64-bit fields as its own int subclass; hand back a plain int.
            kept[key] = int(value)
    return kept


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
    # True: return once sent, not once confirmed (the wait is a round trip to RabbitMQ, on the
    # worker's critical path for every reply); a refusal comes back from `Broker.refused`.
    confirm_later: bool = False


PLAIN = PublishOptions()


@dataclass(frozen=True)
class Refused:
    """A publish made with `confirm_later` that the broker did not take, and why:
    `BackPressureError`, `UnroutableError`, or `BrokerUnavailableError` when the connection
    went before its confirm (it may have arrived: publish again only what bears a duplicate)."""

    exchange: str
    routing_key: str
    body: bytes
    options: PublishOptions
    error: BrokerError


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


def dead_letter_headers(delivery: Delivery, reason: str) -> dict[str, HeaderValue]:
    """A dead-lettered copy's headers: the original's, with ours saying why and whence."""
    headers = dict(delivery.headers)
    headers[REASON_HEADER] = reason
    headers[SOURCE_QUEUE_HEADER] = delivery.queue
    if delivery.user_id is not None:
        headers[USER_HEADER] = delivery.user_id
    return headers


def no_dead_letter_routing(delivery: Delivery) -> BrokerError:
    return BrokerError(
        f"queue {delivery.queue!r} has no dead-letter routing on this handle; "
        "declare its QueueSpec (with dead_letter_routing_key) here first"
    )


def not_outstanding(delivery: Delivery) -> BrokerError:
    return BrokerError(
        f"delivery {delivery.tag} from {delivery.queue!r} is not outstanding on this handle "
        "(already acked/nacked, or received on another handle)"
    )


def unroutable(exchange: str, routing_key: str, why: str = "") -> UnroutableError:
    bound = f"no queue is bound to exchange {exchange!r} with routing key {routing_key!r}"
    return UnroutableError(bound + why)


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

    def refused(self) -> list[Refused]:
        """The `confirm_later` publishes refused since the last call, in publish order (confirms
        arrive while the handle works: any call that waits or receives takes them in)."""
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

    def server_info(self) -> ServerInfo:
        """Who answers and whether it lets us declare and publish (`splitmq doctor`)."""
        ...

    def close(self) -> None:
        """Close the connection; unacked deliveries return to their queues."""
        ...


@dataclass(frozen=True)
class Backoff:
    initial: float
    cap: float

    def delay(self, attempt: int, rng: random.Random) -> float:
        """Exponential in `attempt`, capped, with "equal jitter": between half and all of it."""
        # Bound the exponent: the cap is reached long before 2**32 anyway.
        base = min(self.cap, self.initial * 2.0 ** min(attempt, 32))
        return base / 2 + rng.random() * base / 2
