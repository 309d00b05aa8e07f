"""The embedded `Broker`: RabbitMQ's semantics inside one process, no server needed.

Each thread opens its own `InMemoryBroker` handle over one shared `InMemoryHub`, as it would open
its own RabbitMQ connection; the hub holds the queues. All the hub's state sits behind one lock;
each handle's `Session` waits on its own condition over that lock, so a publish wakes only the
consumer it was dispatched to. Which RabbitMQ rules it keeps (the contract suite holds both
brokers to them): CONTRIBUTING.md, "Adding a broker or a store".
"""

from __future__ import annotations

import contextlib
import itertools
import math
import threading
import time
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace

from broker.errors import BackPressureError, BrokerError, StaleDeliveryError, UnroutableError
from broker.topology import (
    BEST_EFFORT_EXCHANGES,
    DEAD_EXCHANGE,
    EXCHANGES,
    dead_queue,
    dead_queue_name,
)
from broker.transport import (
    DEFAULT_MAX_MESSAGE_BYTES,
    PLAIN,
    Delivery,
    Headers,
    HeaderValue,
    Meter,
    PublishOptions,
    QueueSpec,
    Refused,
    ServerInfo,
    check_publish,
    count_settled,
    dead_letter_headers,
    no_dead_letter_routing,
    not_outstanding,
    outgoing_headers,
    unroutable,
)

__all__ = ["InMemoryBroker", "InMemoryHub"]


@dataclass(eq=False)
class _Message:
    exchange: str
    routing_key: str
    body: bytes
    headers: Headers
    message_id: str | None
    user_id: str | None
    seq: int = 0  # publish order; requeued messages go back to their original position
    redelivered: bool = False


@dataclass(eq=False)
class _Queue:
    spec: QueueSpec
    owner: Session | None  # exclusive queues belong to the session that declared them
    ready: deque[_Message] = field(default_factory=deque)
    ready_bytes: int = 0
    consumers: list[_Consumer] = field(default_factory=list)
    next_consumer: int = 0
    # The spec's bounds, infinite where it has none: every publish compares against them.
    max_length: float = field(init=False)
    max_bytes: float = field(init=False)

    def __post_init__(self) -> None:
        spec = self.spec
        self.max_length = math.inf if spec.max_length is None else spec.max_length
        self.max_bytes = math.inf if spec.max_length_bytes is None else spec.max_length_bytes


@dataclass(eq=False)
class _Consumer:
    session: Session
    queue: _Queue
    prefetch: int
    in_flight: int = 0


@dataclass(eq=False)
class _Pending:
    consumer: _Consumer
    message: _Message


class Session:
    """One handle's view of the hub (its consumers and deliveries); guarded by the hub lock."""

    def __init__(self, lock: threading.Lock) -> None:
        self.wakeup = threading.Condition(lock)
        self.buffer: deque[tuple[Delivery, _Pending]] = deque()  # pushed, not yet handed out
        self.handed: dict[int, _Pending] = {}  # handed out by get(), not yet settled
        self.returned: set[int] = set()  # tags given back by unsubscribe: acking them is stale
        self.consumers: dict[str, _Consumer] = {}
        self.declared: dict[str, QueueSpec] = {}
        self.closed = False


def _declared_args(spec: QueueSpec) -> QueueSpec:
    """What RabbitMQ compares when a queue is declared again: all but the binding (additive),
    and the overflow only of a bounded queue."""
    bounded = spec.max_length is not None or spec.max_length_bytes is not None
    overflow = spec.overflow if bounded else "reject-publish"
    return replace(spec, exchange="", routing_key="", overflow=overflow)


def _overflows(queue: _Queue, size: int) -> bool:
    """Whether one more ready message of `size` bytes would exceed the queue's bounds."""
    return len(queue.ready) >= queue.max_length or queue.ready_bytes + size > queue.max_bytes


def _closed() -> BrokerError:
    return BrokerError("this broker handle is closed")


class InMemoryHub:
    """Exchanges, queues and bindings shared by `InMemoryBroker` handles (thread-safe): they
    work on it with `lock` held."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.exchanges: dict[str, str] = {}
        # exchange -> routing key -> queue names, in binding order
        self._bindings: dict[str, dict[str, list[str]]] = {}
        self.queues: dict[str, _Queue] = {}
        self._tags = itertools.count(1)  # hub-wide, so a tag from another handle is never valid
        self._seq = itertools.count()

    # -- topology -------------------------------------------------------------------------

    def declare_queue(self, session: Session, spec: QueueSpec) -> None:
        if spec.exchange not in self.exchanges:
            raise BrokerError(f"NOT_FOUND - no exchange {spec.exchange!r} to bind {spec.name!r}")
        queue = self.queues.get(spec.name)
        if queue is None:
            queue = _Queue(spec, owner=session if spec.exclusive else None)
            self.queues[spec.name] = queue
        else:
            self.check_access(session, queue)
            if _declared_args(queue.spec) != _declared_args(spec):
                raise BrokerError(
                    f"PRECONDITION_FAILED - inequivalent arguments for queue {spec.name!r}: "
                    f"declared as {queue.spec}, now {spec}"
                )
        bound = self._bindings.setdefault(spec.exchange, {}).setdefault(spec.routing_key, [])
        if spec.name not in bound:
            bound.append(spec.name)
        session.declared[spec.name] = spec

    def remove_queue(self, queue: _Queue) -> None:
        name = queue.spec.name
        del self.queues[name]
        for by_key in self._bindings.values():
            for names in by_key.values():
                if name in names:
                    names.remove(name)
        # The broker cancels the queue's consumers; their unsettled messages die with it.
        for consumer in queue.consumers:
            session = consumer.session
            if session.consumers.get(name) is consumer:
                del session.consumers[name]
            session.buffer = deque(p for p in session.buffer if p[1].consumer is not consumer)
        queue.consumers.clear()

    # -- publishing -----------------------------------------------------------------------

    def route(self, message: _Message) -> list[str]:
        """Enqueue a copy on every bound queue; returns the names of the queues that were full."""
        exchange, routing_key, size = message.exchange, message.routing_key, len(message.body)
        kind = self.exchanges.get(exchange)
        if kind is None:
            raise BrokerError(f"NOT_FOUND - no exchange {exchange!r}")
        by_key = self._bindings.get(exchange, {})
        if kind == "fanout":
            targets = list(dict.fromkeys(itertools.chain.from_iterable(by_key.values())))
        else:
            # Direct, or topic with exact binding keys only (job names and client ids hold
            # neither '*' nor '#'), which RabbitMQ routes as a direct exchange does.
            targets = by_key.get(routing_key, [])
        if not targets:
            if exchange in BEST_EFFORT_EXCHANGES:
                return []
            raise unroutable(exchange, routing_key)
        full: list[str] = []
        for name in targets:
            queue = self.queues[name]
            # `_overflows`, inline: it runs for every message routed.
            if len(queue.ready) >= queue.max_length or queue.ready_bytes + size > queue.max_bytes:
                if queue.spec.overflow == "reject-publish":
                    full.append(name)
                    continue
                if not self._drop_head(queue, size):
                    continue  # larger than the whole bound: RabbitMQ drops it as well
            queue.ready.append(replace(message, seq=next(self._seq), redelivered=False))
            queue.ready_bytes += size
            self.dispatch(queue)
        return full

    # -- consuming ------------------------------------------------------------------------

    def unsubscribe(self, session: Session, name: str) -> None:
        consumer = session.consumers.pop(name, None)
        if consumer is None:
            return
        queue = consumer.queue
        queue.consumers.remove(consumer)
        returned = [p.message for _, p in session.buffer if p.consumer is consumer]
        session.buffer = deque(p for p in session.buffer if p[1].consumer is not consumer)
        for tag, pending in list(session.handed.items()):
            if pending.consumer is consumer:
                del session.handed[tag]
                session.returned.add(tag)
                returned.append(pending.message)
        consumer.in_flight = 0
        if self.queues.get(name) is queue:
            self._requeue(queue, returned)
            if queue.spec.auto_delete and not queue.consumers:
                self.remove_queue(queue)
            else:
                self.dispatch(queue)

    def nack(self, pending: _Pending, requeue: bool) -> None:
        message = pending.message
        queue = pending.consumer.queue
        live = self.queues.get(queue.spec.name) is queue  # else it died with its queue
        if live and requeue:
            self._requeue(queue, [message])
        elif live and (key := queue.spec.dead_letter_routing_key) is not None:
            self._server_dead_letter(queue, message, key)
        self.settle(pending)

    def _server_dead_letter(
        self, queue: _Queue, message: _Message, routing_key: str, why: str = "rejected"
    ) -> None:
        """RabbitMQ's x-dead-letter routing: best effort; an unroutable copy is dropped."""
        headers: dict[str, HeaderValue] = dict(message.headers)
        headers.setdefault("x-first-death-reason", why)
        headers.setdefault("x-first-death-queue", queue.spec.name)
        headers.setdefault("x-first-death-exchange", message.exchange)
        dead = replace(message, exchange=DEAD_EXCHANGE, routing_key=routing_key, headers=headers)
        # RabbitMQ drops a dead letter it cannot route; so do we, to stay comparable.
        with contextlib.suppress(BrokerError):
            self.route(dead)

    # -- internals --------------------------------------------------------------------------

    def dispatch(self, queue: _Queue) -> None:
        """Hand ready messages to consumers with room under their prefetch: round robin, or
        only the first of a single-active-consumer queue."""
        consumers = queue.consumers
        while queue.ready and consumers:
            if queue.spec.single_active_consumer:
                consumer = consumers[0]
                if consumer.in_flight >= consumer.prefetch:
                    return
            else:
                count = len(consumers)
                for step in range(count):
                    index = (queue.next_consumer + step) % count
                    consumer = consumers[index]
                    if consumer.in_flight < consumer.prefetch:
                        queue.next_consumer = (index + 1) % count
                        break
                else:
                    return
            message = queue.ready.popleft()
            queue.ready_bytes -= len(message.body)
            consumer.in_flight += 1
            delivery = Delivery(
                body=message.body,
                queue=queue.spec.name,
                routing_key=message.routing_key,
                tag=next(self._tags),
                redelivered=message.redelivered,
                headers=message.headers,
                message_id=message.message_id,
                user_id=message.user_id,
            )
            consumer.session.buffer.append((delivery, _Pending(consumer, message)))
            consumer.session.wakeup.notify()

    def _drop_head(self, queue: _Queue, size: int) -> bool:
        """Discard the oldest ready messages until one of `size` bytes fits (dead-lettering
        them as "maxlen" where the queue has dead-letter routing); False if it never can."""
        while queue.ready and _overflows(queue, size):
            dropped = queue.ready.popleft()
            queue.ready_bytes -= len(dropped.body)
            if (key := queue.spec.dead_letter_routing_key) is not None:
                self._server_dead_letter(queue, dropped, key, "maxlen")
        return not _overflows(queue, size)

    def _requeue(self, queue: _Queue, messages: list[_Message]) -> None:
        if not messages:
            return
        for message in messages:
            message.redelivered = True
        messages.sort(key=lambda m: m.seq)
        if not queue.ready or messages[-1].seq < queue.ready[0].seq:
            queue.ready.extendleft(reversed(messages))
        else:
            queue.ready = deque(sorted([*queue.ready, *messages], key=lambda m: m.seq))
        queue.ready_bytes += sum(len(m.body) for m in messages)

    def settle(self, pending: _Pending) -> None:
        consumer = pending.consumer
        consumer.in_flight -= 1
        queue = consumer.queue
        if queue.ready and self.queues.get(queue.spec.name) is queue:
            self.dispatch(queue)

    def queue(self, session: Session, name: str) -> _Queue:
        queue = self.queues.get(name)
        if queue is None:
            raise BrokerError(f"NOT_FOUND - no queue {name!r}")
        self.check_access(session, queue)
        return queue

    @staticmethod
    def check_access(session: Session, queue: _Queue) -> None:
        if queue.owner is not None and queue.owner is not session:
            raise BrokerError(
                f"RESOURCE_LOCKED - queue {queue.spec.name!r} is exclusive to another handle"
            )


class InMemoryBroker:
    """One handle (like one connection) on an `InMemoryHub`; implements `broker.transport.Broker`.

    `user` plays the authenticated AMQP user: when set, a publish whose `user_id` differs is
    refused as RabbitMQ would. `hub=None` gives the handle a private hub. `stamp` is the user_id
    of publishes that name none; `meter` hears of every message sent, received and dead-lettered.
    """

    def __init__(
        self,
        hub: InMemoryHub | None = None,
        *,
        user: str | None = None,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        stamp: str | None = None,
        meter: Meter | None = None,
    ) -> None:
        self.hub = hub if hub is not None else InMemoryHub()
        self._session = Session(self.hub.lock)
        self._user = user
        self._max_message_bytes = max_message_bytes
        self.stamp = stamp
        self.meter = meter
        self._refused: list[Refused] = []

    @contextlib.contextmanager
    def _open(self) -> Iterator[Session]:
        """The hub's lock held, on a handle that is not closed: its session. (publish, get and
        ack, run for every message, do the same inline.)"""
        with self.hub.lock:
            if self._session.closed:
                raise _closed()
            yield self._session

    def declare(self, queues: Sequence[QueueSpec]) -> None:
        with self._open() as session:
            for name, kind in EXCHANGES:
                self.hub.exchanges.setdefault(name, kind)
            for spec in queues:
                self.hub.declare_queue(session, spec)

    def publish(
        self, exchange: str, routing_key: str, body: bytes, options: PublishOptions = PLAIN
    ) -> None:
        # `persistent` means nothing here: nothing outlives the process anyway.
        started = time.perf_counter()
        user_id = options.user_id or self.stamp
        target = f"exchange {exchange!r}, key {routing_key!r}"
        check_publish(body, self._max_message_bytes, user_id, self._user, target)
        headers = (outgoing_headers(options.headers) or {}) if options.headers else {}
        try:
            message = _Message(exchange, routing_key, body, headers, options.message_id, user_id)
            with self.hub.lock:
                if self._session.closed:
                    raise _closed()
                full = self.hub.route(message)
            if full:
                raise BackPressureError(
                    f"queue(s) {', '.join(full)} full (reject-publish): exchange {exchange!r} "
                    f"routing key {routing_key!r} refused the message; retry later"
                )
        except (BackPressureError, UnroutableError) as exc:
            if not options.confirm_later:
                raise
            self._refused.append(Refused(exchange, routing_key, body, options, exc))
            return
        if self.meter is not None:
            self.meter.sent(routing_key, len(body), time.perf_counter() - started)

    def refused(self) -> list[Refused]:
        taken, self._refused = self._refused, []
        return taken

    def subscribe(self, queue: str, *, prefetch: int) -> None:
        if prefetch < 1:
            raise ValueError(f"prefetch must be at least 1, got {prefetch}")
        with self._open() as session:
            found = self.hub.queue(session, queue)
            if queue not in session.consumers:
                consumer = _Consumer(session, found, prefetch)
                session.consumers[queue] = consumer
                found.consumers.append(consumer)
                self.hub.dispatch(found)

    def unsubscribe(self, queue: str) -> None:
        with self._open() as session:
            self.hub.unsubscribe(session, queue)

    def get(self, timeout: float) -> Delivery | None:
        started = time.perf_counter()
        session = self._session
        with self.hub.lock:
            if session.closed:
                raise _closed()
            if not session.buffer:
                # Condition.wait_for, without a predicate to call on each wake-up.
                deadline = time.monotonic() + timeout
                while not session.buffer and not session.closed:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0.0:
                        break
                    session.wakeup.wait(remaining)
                if session.closed:
                    raise _closed()
            delivery: Delivery | None = None
            if session.buffer:
                delivery, pending = session.buffer.popleft()
                session.handed[delivery.tag] = pending
        if self.meter is not None:
            size = 0 if delivery is None else len(delivery.body)
            self.meter.received(size, time.perf_counter() - started)
        return delivery

    def ack(self, delivery: Delivery) -> None:
        session = self._session
        with self.hub.lock:
            if session.closed:
                raise _closed()
            # `_take`, inline for a delivery that is outstanding (it raises for the others).
            pending = session.handed.pop(delivery.tag, None) or self._take(delivery)
            self.hub.settle(pending)

    def nack(self, delivery: Delivery, *, requeue: bool) -> None:
        with self._open():
            self.hub.nack(self._take(delivery), requeue)
        if not requeue and self.meter is not None:
            self.meter.dead_lettered(None)

    def dead_letter(self, delivery: Delivery, reason: str) -> None:
        with self._open():
            self._dead_letter(delivery, reason)
        if self.meter is not None:
            self.meter.dead_lettered(reason)

    def dead_letter_many(
        self, letters: Sequence[tuple[Delivery, str]]
    ) -> list[tuple[Delivery, BrokerError]]:
        unsettled: list[tuple[Delivery, BrokerError]] = []
        with self._open() as session:
            for delivery, _ in letters:  # usage errors first, before anything is settled
                if delivery.tag not in session.handed and delivery.tag not in session.returned:
                    raise not_outstanding(delivery)
            for delivery, reason in letters:
                try:
                    self._dead_letter(delivery, reason)
                except BrokerError as exc:  # stale included
                    unsettled.append((delivery, exc))
        if self.meter is not None:
            count_settled(self.meter, letters, unsettled)
        return unsettled

    def _dead_letter(self, delivery: Delivery, reason: str) -> None:
        """Copy to the queue's dead-letter routing with `reason`, then settle (lock held)."""
        session = self._session
        spec = session.declared.get(delivery.queue)
        if spec is None or (key := spec.dead_letter_routing_key) is None:
            raise no_dead_letter_routing(delivery)
        message = self._peek(delivery).message
        headers = dead_letter_headers(delivery, reason)
        copy = _Message(DEAD_EXCHANGE, key, message.body, headers, message.message_id, None)
        try:
            full = self.hub.route(copy)
        except UnroutableError:
            # `<job>.dead` was deleted: declare it again and retry once, as RabbitMQ does.
            dead = session.declared.get(dead_queue_name(key)) or dead_queue(key)
            self.hub.declare_queue(session, dead)
            full = self.hub.route(copy)
        if full:
            raise BackPressureError(f"dead-letter queue(s) {', '.join(full)} full")
        self.hub.settle(self._take(delivery))

    def _peek(self, delivery: Delivery) -> _Pending:
        session = self._session
        pending = session.handed.get(delivery.tag)
        if pending is not None:
            return pending
        if delivery.tag in session.returned:
            session.returned.discard(delivery.tag)
            raise StaleDeliveryError(
                f"delivery {delivery.tag} from {delivery.queue!r} was returned to its queue "
                "(unsubscribed); it will be redelivered"
            )
        raise not_outstanding(delivery)

    def _take(self, delivery: Delivery) -> _Pending:
        pending = self._peek(delivery)
        del self._session.handed[delivery.tag]
        return pending

    def queue_depth(self, queue: str) -> int:
        with self._open() as session:
            return len(self.hub.queue(session, queue).ready)

    def delete_queue(self, queue: str) -> None:
        with self._open() as session:
            session.declared.pop(queue, None)
            found = self.hub.queues.get(queue)
            if found is not None:  # deleting a missing queue succeeds, as on RabbitMQ
                self.hub.check_access(session, found)
                self.hub.remove_queue(found)

    def close(self) -> None:
        session = self._session
        with self.hub.lock:
            if session.closed:
                return
            for name in list(session.consumers):
                self.hub.unsubscribe(session, name)
            session.returned.clear()
            for queue in [q for q in self.hub.queues.values() if q.owner is session]:
                self.hub.remove_queue(queue)
            session.closed = True
            session.wakeup.notify_all()

    def server_info(self) -> ServerInfo:
        """Always healthy: the broker lives in this process."""
        return ServerInfo(
            product="SplitMQ in-memory broker",
            version="1",
            can_declare=True,
            can_publish=True,
            max_message_bytes=self._max_message_bytes,
        )

    def __enter__(self) -> InMemoryBroker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
