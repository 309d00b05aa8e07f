"""One contract for every `Broker`: the in-memory broker and RabbitMQ must behave alike.

Each test runs twice, once per implementation. The RabbitMQ run needs a real server
(`amqp_url` skips locally, fails under CI=true); queue names come from the `job` fixture so
parallel runs on one server never meet, and every queue a test declares is deleted afterwards.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from broker.errors import (
    BackPressureError,
    BrokerError,
    MessageTooLargeError,
    StaleDeliveryError,
    UnroutableError,
)
from broker.memory_broker import InMemoryBroker, InMemoryHub
from broker.rabbitmq import RabbitMQBroker, RabbitMQOptions
from broker.rejection import Rejected, dead_letter_many_safely, dead_letter_safely
from broker.topology import (
    CONTROL_EXCHANGE,
    DEAD_EXCHANGE,
    EVENTS_EXCHANGE,
    REPLIES_EXCHANGE,
    SMASHED_EXCHANGE,
    QueueLimits,
    client_infer_reply_queue,
    control_queue,
    dead_queue,
    host_queue,
    infer_reply_queue,
    job_queues,
    reply_queue,
    updates_queue,
)
from broker.transport import (
    DEFAULT_MAX_MESSAGE_BYTES,
    REASON_HEADER,
    SOURCE_QUEUE_HEADER,
    USER_HEADER,
    Broker,
    Delivery,
    HeaderValue,
    PublishOptions,
    QueueSpec,
    Refused,
)
from tests.integration import test_rabbitmq_specific as rabbit

USER = "guest"  # RabbitMQ checks user_id against the connection's user: the test server's
WAIT = 5.0  # for a delivery that must come
QUIET = 0.3  # for one that must not (a broker breaking the rule would deliver well within it)


class BrokerFactory:
    """Opens handles on one broker (as separate threads or processes would) and cleans up.

    `quorum`: the queues are quorum queues. `slack`: how many messages past its bound a
    reject-publish queue takes. A quorum queue
    checks its bound before it enqueues (refusing once it is over, not when the publish would
    take it over), so it holds one message more than a classic queue or the hub.
    """

    def __init__(self, job: str, opener: Callable[[int, int], Broker], quorum: bool) -> None:
        self.job = job
        self.quorum = quorum
        self.slack = int(quorum)
        self._opener = opener
        self._handles: list[Broker] = []
        self._queues: list[str] = []

    def __call__(self, *, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> Broker:
        handle = self._opener(len(self._handles), max_message_bytes)
        self._handles.append(handle)
        return handle

    def spec(self, suffix: str, exchange: str = CONTROL_EXCHANGE, **options: Any) -> QueueSpec:
        """A queue of this test, bound with its own name as routing key; deleted at teardown."""
        name = f"{self.job}.{suffix}"
        return self.track(QueueSpec(name=name, exchange=exchange, routing_key=name, **options))

    def track(self, spec: QueueSpec) -> QueueSpec:
        self._queues.append(spec.name)
        return spec

    def teardown(self) -> None:
        for handle in self._handles:
            handle.close()
        if self._queues:
            cleaner = self._opener(len(self._handles), DEFAULT_MAX_MESSAGE_BYTES)
            for name in self._queues:
                cleaner.delete_queue(name)
            cleaner.close()


@pytest.fixture(
    params=[
        "memory",
        pytest.param("rabbitmq", marks=pytest.mark.rabbitmq),
        pytest.param("rabbitmq-quorum", marks=pytest.mark.rabbitmq),
    ]
)
def broker_factory(request: pytest.FixtureRequest, job: str) -> Iterator[BrokerFactory]:
    """Handles on the in-memory hub, or on RabbitMQ with classic or with quorum queues (every
    durable shared queue a test declares is then a quorum queue)."""
    if request.param == "memory":
        hub = InMemoryHub()

        def opener(index: int, max_message_bytes: int) -> Broker:
            return InMemoryBroker(hub, user=USER, max_message_bytes=max_message_bytes)

    else:
        url = request.getfixturevalue("amqp_url")

        def opener(index: int, max_message_bytes: int) -> Broker:
            options = RabbitMQOptions(
                give_up_after=5.0,
                max_message_bytes=max_message_bytes,
                connection_name=f"{job}-{index}",
                queue_type="quorum" if request.param == "rabbitmq-quorum" else "classic",
            )
            return RabbitMQBroker(url, options)

    factory = BrokerFactory(job, opener, quorum=request.param == "rabbitmq-quorum")
    yield factory
    factory.teardown()


def receive(broker: Broker, count: int = 1) -> list[Delivery]:
    deliveries: list[Delivery] = []
    for _ in range(count):
        delivery = broker.get(WAIT)
        assert delivery is not None, f"expected {count} deliveries, got {len(deliveries)}"
        deliveries.append(delivery)
    return deliveries


def bad_messages(
    consumer: Broker, dead: QueueSpec, control: QueueSpec, count: int
) -> list[Delivery]:
    """Declare `dead` and `control`, put `count` bodies `bad-<i>` on `control`, take them."""
    consumer.declare([dead, control])
    for index in range(count):
        consumer.publish(CONTROL_EXCHANGE, control.routing_key, f"bad-{index}".encode())
    consumer.subscribe(control.name, prefetch=count)
    return receive(consumer, count)


def test_server_info_says_who_answers_and_that_declare_and_publish_work(
    broker_factory: BrokerFactory,
) -> None:
    """`splitmq doctor`'s probe, on every backend (part of the `Broker` protocol)."""
    info = broker_factory().server_info()
    assert info.product and info.version
    assert (info.can_declare, info.can_publish, info.detail) == (True, True, "")
    assert info.max_message_bytes > 0


def test_round_trip_carries_body_headers_and_ids(broker_factory: BrokerFactory) -> None:
    broker = broker_factory()
    spec = broker_factory.spec("work")
    broker.declare([spec])
    headers: dict[str, HeaderValue] = {
        "kind": "smashed",
        "seq": 7,
        "big": 1 << 40,
        "final": True,
        "raw": b"\x00\x01",
    }
    body = bytes(range(256)) * 4

    broker.publish(
        CONTROL_EXCHANGE,
        spec.routing_key,
        body,
        PublishOptions(headers=headers, message_id="m-1", user_id=USER),
    )
    assert broker.queue_depth(spec.name) == 1
    broker.subscribe(spec.name, prefetch=1)
    (delivery,) = receive(broker)

    assert delivery.body == body
    assert dict(delivery.headers) == headers
    assert (delivery.message_id, delivery.user_id) == ("m-1", USER)
    assert (delivery.queue, delivery.routing_key) == (spec.name, spec.routing_key)
    assert not delivery.redelivered
    broker.ack(delivery)
    broker.close()

    # Acked means gone: a fresh consumer finds nothing.
    later = broker_factory()
    later.subscribe(spec.name, prefetch=1)
    assert later.get(QUIET) is None
    assert later.queue_depth(spec.name) == 0


def test_publishing_as_another_user_is_refused(broker_factory: BrokerFactory) -> None:
    broker = broker_factory()
    spec = broker_factory.spec("work")
    broker.declare([spec])

    with pytest.raises(BrokerError, match="user_id"):
        broker.publish(
            CONTROL_EXCHANGE, spec.routing_key, b"forged", PublishOptions(user_id="mallory")
        )

    assert broker.queue_depth(spec.name) == 0
    broker.publish(CONTROL_EXCHANGE, spec.routing_key, b"honest", PublishOptions(user_id=USER))
    assert broker.queue_depth(spec.name) == 1


def test_unacked_message_survives_a_consumer_that_dies(broker_factory: BrokerFactory) -> None:
    publisher = broker_factory()
    spec = broker_factory.spec("work")
    publisher.declare([spec])
    publisher.publish(
        CONTROL_EXCHANGE, spec.routing_key, b"precious", PublishOptions(message_id="p-1")
    )

    doomed = broker_factory()
    doomed.subscribe(spec.name, prefetch=1)
    (first,) = receive(doomed)
    assert not first.redelivered
    doomed.close()  # no ack: as if the worker was killed mid-batch

    survivor = broker_factory()
    survivor.subscribe(spec.name, prefetch=1)
    (again,) = receive(survivor)
    assert (again.body, again.message_id, again.redelivered) == (b"precious", "p-1", True)
    survivor.ack(again)


def test_nack_with_requeue_redelivers(broker_factory: BrokerFactory) -> None:
    broker = broker_factory()
    spec = broker_factory.spec("work")
    broker.declare([spec])
    broker.publish(CONTROL_EXCHANGE, spec.routing_key, b"retry me")
    broker.subscribe(spec.name, prefetch=1)

    (first,) = receive(broker)
    broker.nack(first, requeue=True)
    (second,) = receive(broker)

    assert (second.body, second.redelivered) == (b"retry me", True)
    broker.ack(second)
    assert broker.get(QUIET) is None


def test_rejected_body_is_dead_lettered_with_reason_and_consumer_goes_on(
    broker_factory: BrokerFactory,
) -> None:
    job = broker_factory.job
    dead, control = broker_factory.track(dead_queue(job)), broker_factory.track(control_queue(job))
    consumer = broker_factory()
    consumer.declare([dead, control])
    bodies = [b"good-1", b"\xc1 not msgpack", b"good-2"]
    for index, body in enumerate(bodies):
        consumer.publish(
            CONTROL_EXCHANGE,
            control.routing_key,
            body,
            PublishOptions(headers={"trace": f"t{index}"}, message_id=f"m{index}", user_id=USER),
        )
    consumer.subscribe(control.name, prefetch=2)

    handled = []
    for _ in bodies:
        (delivery,) = receive(consumer)
        if delivery.body.startswith(b"good"):
            handled.append(delivery.body)
            consumer.ack(delivery)
        else:
            consumer.dead_letter(delivery, "DecodeError: byte 0xc1 is not valid msgpack")

    assert handled == [b"good-1", b"good-2"]
    assert consumer.queue_depth(control.name) == 0
    operator = broker_factory()
    operator.subscribe(dead.name, prefetch=5)
    (letter,) = receive(operator)
    assert letter.body == b"\xc1 not msgpack"
    assert letter.headers[REASON_HEADER] == "DecodeError: byte 0xc1 is not valid msgpack"
    assert letter.headers[SOURCE_QUEUE_HEADER] == control.name
    assert letter.headers["trace"] == "t1"
    assert letter.headers[USER_HEADER] == USER
    assert letter.message_id == "m1"
    operator.ack(letter)
    assert operator.get(QUIET) is None


def test_nack_without_requeue_follows_the_queue_dead_letter_routing(
    broker_factory: BrokerFactory,
) -> None:
    job = broker_factory.job
    dead, control = broker_factory.track(dead_queue(job)), broker_factory.track(control_queue(job))
    broker = broker_factory()
    broker.declare([dead, control])
    broker.publish(
        CONTROL_EXCHANGE, control.routing_key, b"unwanted", PublishOptions(message_id="u-1")
    )
    broker.subscribe(control.name, prefetch=1)

    (delivery,) = receive(broker)
    broker.nack(delivery, requeue=False)
    broker.subscribe(dead.name, prefetch=1)
    (letter,) = receive(broker)

    assert (letter.body, letter.message_id, letter.queue) == (b"unwanted", "u-1", dead.name)
    assert letter.headers["x-first-death-reason"] == "rejected"
    assert letter.headers["x-first-death-queue"] == control.name
    assert REASON_HEADER not in letter.headers
    broker.ack(letter)


def test_dead_letter_declares_a_deleted_dead_letter_queue_again(
    broker_factory: BrokerFactory,
) -> None:
    # An operator purging junk by deleting `<job>.dead`: the next bad message must neither
    # crash its consumer nor stay unacked (issue 18, item 1).
    job = broker_factory.job
    dead, control = broker_factory.track(dead_queue(job)), broker_factory.track(control_queue(job))
    consumer = broker_factory()
    consumer.declare([dead, control])
    broker_factory().delete_queue(dead.name)
    consumer.publish(
        CONTROL_EXCHANGE, control.routing_key, b"\xc1 junk", PublishOptions(message_id="j-1")
    )
    consumer.publish(CONTROL_EXCHANGE, control.routing_key, b"good")
    consumer.subscribe(control.name, prefetch=1)

    (junk,) = receive(consumer)
    assert dead_letter_safely(consumer, junk, "undecodable: 0xc1") is Rejected.DEAD_LETTERED
    (good,) = receive(consumer)  # the consumer goes on
    consumer.ack(good)

    assert consumer.queue_depth(control.name) == 0
    operator = broker_factory()
    operator.subscribe(dead.name, prefetch=5)
    (letter,) = receive(operator)
    assert (letter.body, letter.message_id) == (b"\xc1 junk", "j-1")
    assert letter.headers[REASON_HEADER] == "undecodable: 0xc1"
    operator.ack(letter)
    # Declared again as the topology says (bounded, drop-head): re-declaring it is no clash.
    broker_factory().declare([dead])


def test_dead_letter_queue_drops_its_oldest_when_full(broker_factory: BrokerFactory) -> None:
    # drop-head: a flood of junk never blocks dead-lettering, and the newest letters stay.
    job = broker_factory.job
    limits = QueueLimits(dead_max_length=2)
    dead = broker_factory.track(dead_queue(job, limits))
    control = broker_factory.track(control_queue(job, limits))
    consumer = broker_factory()

    outcomes = [
        dead_letter_safely(consumer, d, "bad") for d in bad_messages(consumer, dead, control, 4)
    ]

    assert outcomes == [Rejected.DEAD_LETTERED] * 4
    assert consumer.queue_depth(dead.name) == 2
    operator = broker_factory()
    operator.subscribe(dead.name, prefetch=5)
    letters = receive(operator, 2)
    assert [d.body for d in letters] == [b"bad-2", b"bad-3"]
    for letter in letters:
        operator.ack(letter)


def test_dead_letter_queue_byte_bound_drops_its_oldest(broker_factory: BrokerFactory) -> None:
    job = broker_factory.job
    dead = broker_factory.track(dead_queue(job, QueueLimits(dead_max_length_bytes=100)))
    broker = broker_factory()
    broker.declare([dead])
    for body in (b"a" * 60, b"b" * 40, b"c" * 30):
        broker.publish(DEAD_EXCHANGE, job, body)  # never refused: the oldest made room

    assert broker.queue_depth(dead.name) == 2
    broker.subscribe(dead.name, prefetch=2)
    letters = receive(broker, 2)
    assert [d.body for d in letters] == [b"b" * 40, b"c" * 30]
    for letter in letters:
        broker.ack(letter)


@pytest.mark.parametrize("which", ["control", "updates"])
def test_control_and_updates_queues_push_back_when_full(
    broker_factory: BrokerFactory, which: str
) -> None:
    # A client can publish into both: bounded, and full means refused (nothing dropped).
    job = broker_factory.job
    limits = QueueLimits(control_max_length=2, updates_max_length=2)
    make = control_queue if which == "control" else updates_queue
    spec = broker_factory.track(make(job, limits))
    broker = broker_factory()
    broker.declare([spec])
    taken = 2 + broker_factory.slack
    for index in range(taken):
        broker.publish(CONTROL_EXCHANGE, spec.routing_key, f"m{index}".encode())

    with pytest.raises(BackPressureError, match=spec.name):
        broker.publish(CONTROL_EXCHANGE, spec.routing_key, b"refused")
    assert broker.queue_depth(spec.name) == taken


def test_every_job_queue_a_client_can_reach_is_bounded() -> None:
    for spec in job_queues("j", 2):
        assert spec.max_length is not None and spec.max_length_bytes is not None, spec.name
        expected = "drop-head" if spec.exchange == DEAD_EXCHANGE else "reject-publish"
        assert spec.overflow == expected, spec.name


def _reply_queues(job: str, limits: QueueLimits | None = None) -> list[QueueSpec]:
    return [
        reply_queue(job, "c", limits),
        infer_reply_queue(job, "r", limits),
        client_infer_reply_queue(job, "c", limits),
        host_queue(job, "H", limits=limits),
        host_queue(job, "H", "H-0", limits),
    ]


def test_every_reply_queue_is_bounded_and_refuses_when_full() -> None:
    # Each message a client sends may be answered on its reply queue (a Join with a Welcome
    # holding its weights): one that keeps asking and never reads must not grow it without end.
    limits = QueueLimits()
    for spec in _reply_queues("j"):
        assert spec.max_length is not None and spec.max_length_bytes is not None, spec.name
        assert spec.overflow == "reject-publish", spec.name
        # Room for a Welcome and assignments of RabbitMQ's largest message, and a reply for
        # every batch the client's shard queue can hold.
        assert spec.max_length >= limits.max_length, spec.name
        assert spec.max_length_bytes >= 3 * DEFAULT_MAX_MESSAGE_BYTES, spec.name


@pytest.mark.parametrize("which", range(4))
def test_reply_queues_push_back_when_full(broker_factory: BrokerFactory, which: int) -> None:
    # The same bound on both brokers: a full reply queue refuses the publisher (a service),
    # which then knows the client is not reading.
    job = broker_factory.job
    limits = QueueLimits(reply_max_length=2, host_max_length=2)
    spec = broker_factory.track(_reply_queues(job, limits)[which])
    broker = broker_factory()
    broker.declare([spec])
    taken = 2 + (broker_factory.slack if spec.durable else 0)
    for index in range(taken):
        broker.publish(REPLIES_EXCHANGE, spec.routing_key, f"m{index}".encode())

    with pytest.raises(BackPressureError, match=spec.name):
        broker.publish(REPLIES_EXCHANGE, spec.routing_key, b"refused")
    assert broker.queue_depth(spec.name) == taken


def test_dead_letter_needs_the_queue_declared_on_the_handle(
    broker_factory: BrokerFactory,
) -> None:
    job = broker_factory.job
    dead, control = broker_factory.track(dead_queue(job)), broker_factory.track(control_queue(job))
    broker_factory().declare([dead, control])
    broker = broker_factory()
    broker.subscribe(control.name, prefetch=1)
    broker.publish(CONTROL_EXCHANGE, control.routing_key, b"x")
    (delivery,) = receive(broker)

    with pytest.raises(BrokerError, match="dead-letter routing"):
        broker.dead_letter(delivery, "bad")

    broker.ack(delivery)  # still outstanding: nothing was lost or settled by the refusal
    assert broker.queue_depth(dead.name) == 0


# -- batched dead letters (a flood's surplus: one wait for the broker, not one per message) ----


def dead_letters(broker_factory: BrokerFactory, dead: QueueSpec, count: int) -> list[Delivery]:
    """The first `count` messages of `dead`, acked (and nothing more within QUIET)."""
    operator = broker_factory()
    operator.subscribe(dead.name, prefetch=count + 1)
    letters = receive(operator, count)
    assert operator.get(QUIET) is None
    for letter in letters:
        operator.ack(letter)
    return letters


def test_dead_letter_many_copies_each_with_its_reason_then_settles(
    broker_factory: BrokerFactory,
) -> None:
    job = broker_factory.job
    dead, control = broker_factory.track(dead_queue(job)), broker_factory.track(control_queue(job))
    consumer = broker_factory()
    consumer.declare([dead, control])
    for index in range(5):
        consumer.publish(
            CONTROL_EXCHANGE,
            control.routing_key,
            f"junk-{index}".encode(),
            PublishOptions(headers={"trace": f"t{index}"}, message_id=f"m{index}", user_id=USER),
        )
    consumer.subscribe(control.name, prefetch=5)
    deliveries = receive(consumer, 5)

    letters = [(d, f"over_budget: letter {i}") for i, d in enumerate(deliveries)]
    assert consumer.dead_letter_many(letters) == []
    assert consumer.dead_letter_many([]) == []

    assert consumer.queue_depth(control.name) == 0
    assert consumer.get(QUIET) is None  # settled: nothing comes back
    copies = dead_letters(broker_factory, dead, 5)
    assert [c.body for c in copies] == [f"junk-{i}".encode() for i in range(5)]
    for index, copy in enumerate(copies):
        assert copy.headers[REASON_HEADER] == f"over_budget: letter {index}"
        assert copy.headers[SOURCE_QUEUE_HEADER] == control.name
        assert copy.headers[USER_HEADER] == USER
        assert copy.headers["trace"] == f"t{index}"
        assert copy.message_id == f"m{index}"


def test_dead_letter_many_declares_a_deleted_dead_letter_queue_again(
    broker_factory: BrokerFactory,
) -> None:
    job = broker_factory.job
    dead, control = broker_factory.track(dead_queue(job)), broker_factory.track(control_queue(job))
    consumer = broker_factory()
    consumer.declare([dead, control])
    broker_factory().delete_queue(dead.name)
    for index in range(3):
        consumer.publish(CONTROL_EXCHANGE, control.routing_key, f"junk-{index}".encode())
    consumer.subscribe(control.name, prefetch=3)
    letters = [(d, "undecodable: 0xc1") for d in receive(consumer, 3)]

    assert dead_letter_many_safely(consumer, letters) == [Rejected.DEAD_LETTERED] * 3

    assert consumer.queue_depth(control.name) == 0
    copies = dead_letters(broker_factory, dead, 3)
    assert [c.body for c in copies] == [b"junk-0", b"junk-1", b"junk-2"]
    assert all(c.headers[REASON_HEADER] == "undecodable: 0xc1" for c in copies)
    broker_factory().declare([dead])  # declared again as the topology says


def test_dead_letter_many_leaves_stale_deliveries_to_be_redelivered(
    broker_factory: BrokerFactory,
) -> None:
    # A delivery whose connection (here: subscription) is gone comes back and is judged again;
    # it gets no copy, so it is not dead-lettered twice.
    job = broker_factory.job
    dead, control = broker_factory.track(dead_queue(job)), broker_factory.track(control_queue(job))
    other = broker_factory.track(updates_queue(job))
    consumer = broker_factory()
    consumer.declare([dead, control, other])
    consumer.publish(CONTROL_EXCHANGE, control.routing_key, b"returned")
    consumer.publish(CONTROL_EXCHANGE, other.routing_key, b"held")
    consumer.subscribe(control.name, prefetch=1)
    consumer.subscribe(other.name, prefetch=1)
    first, second = receive(consumer, 2)
    returned, held = (first, second) if first.body == b"returned" else (second, first)
    consumer.unsubscribe(control.name)

    outcomes = dead_letter_many_safely(consumer, [(returned, "bad"), (held, "bad too")])

    assert outcomes == [Rejected.REDELIVERED, Rejected.DEAD_LETTERED]
    (copy,) = dead_letters(broker_factory, dead, 1)
    assert (copy.body, copy.headers[REASON_HEADER]) == (b"held", "bad too")
    again = broker_factory()
    again.subscribe(control.name, prefetch=1)
    (redelivered,) = receive(again)
    assert (redelivered.body, redelivered.redelivered) == (b"returned", True)
    again.ack(redelivered)


def test_dead_letter_many_refuses_a_delivery_not_outstanding_before_settling_any(
    broker_factory: BrokerFactory,
) -> None:
    job = broker_factory.job
    dead, control = broker_factory.track(dead_queue(job)), broker_factory.track(control_queue(job))
    consumer = broker_factory()
    consumer.declare([dead, control])
    for body in (b"acked", b"junk"):
        consumer.publish(CONTROL_EXCHANGE, control.routing_key, body)
    consumer.subscribe(control.name, prefetch=2)
    acked, junk = receive(consumer, 2)
    consumer.ack(acked)

    with pytest.raises(BrokerError, match="not outstanding"):
        consumer.dead_letter_many([(junk, "bad"), (acked, "bad")])

    consumer.ack(junk)  # still outstanding: the refusal settled nothing
    assert consumer.queue_depth(dead.name) == 0


def test_dead_letter_many_without_routing_falls_back_per_letter(
    broker_factory: BrokerFactory,
) -> None:
    job = broker_factory.job
    dead, control = broker_factory.track(dead_queue(job)), broker_factory.track(control_queue(job))
    plain = broker_factory.spec("plain")  # no dead-letter routing
    consumer = broker_factory()
    consumer.declare([dead, control, plain])
    consumer.publish(CONTROL_EXCHANGE, plain.routing_key, b"nowhere to go")
    consumer.publish(CONTROL_EXCHANGE, control.routing_key, b"junk")
    consumer.subscribe(plain.name, prefetch=1)
    consumer.subscribe(control.name, prefetch=1)
    deliveries = {d.body: d for d in receive(consumer, 2)}
    letters = [(deliveries[b"nowhere to go"], "bad"), (deliveries[b"junk"], "bad too")]

    unsettled = consumer.dead_letter_many(letters)
    assert [(d.body, type(e)) for d, e in unsettled] == [(b"nowhere to go", BrokerError)]
    assert "dead-letter routing" in str(unsettled[0][1])
    # Left unsettled; the safe path rejects it (never requeued: a poison message must not loop).
    assert dead_letter_many_safely(consumer, letters[:1]) == [Rejected.WITHOUT_REASON]
    assert consumer.get(QUIET) is None
    assert consumer.queue_depth(plain.name) == 0
    (copy,) = dead_letters(broker_factory, dead, 1)
    assert (copy.body, copy.headers[REASON_HEADER]) == (b"junk", "bad too")


def test_dead_letter_many_into_a_full_dead_letter_queue(broker_factory: BrokerFactory) -> None:
    # The topology's drop-head keeps the newest; a dead-letter queue that refuses when full
    # (not the topology's) pushes back, and the safe path rejects what it refused.
    job = broker_factory.job
    limits = QueueLimits(dead_max_length=2)
    dead = broker_factory.track(dead_queue(job, limits))
    control = broker_factory.track(control_queue(job, limits))
    consumer = broker_factory()
    letters = [(d, "bad") for d in bad_messages(consumer, dead, control, 4)]

    assert dead_letter_many_safely(consumer, letters) == [Rejected.DEAD_LETTERED] * 4
    assert [c.body for c in dead_letters(broker_factory, dead, 2)] == [b"bad-2", b"bad-3"]


def test_dead_letter_many_into_a_refusing_dead_letter_queue(broker_factory: BrokerFactory) -> None:
    job = broker_factory.job
    refusing = broker_factory.track(
        QueueSpec(
            name=dead_queue(job).name,
            exchange=DEAD_EXCHANGE,
            routing_key=job,
            max_length=1,
            overflow="reject-publish",
        )
    )
    control = broker_factory.track(control_queue(job))
    consumer = broker_factory()
    # A quorum queue learns it is over its bound after the fact, so which of a batch of
    # pipelined copies it refuses depends on timing: there the queue is over it beforehand.
    fillers = [f"filler-{i}".encode() for i in range(1 + broker_factory.slack)]
    consumer.declare([refusing])
    for body in fillers if broker_factory.slack else []:
        consumer.publish(DEAD_EXCHANGE, job, body)
    letters = [(d, "bad") for d in bad_messages(consumer, refusing, control, 3)]
    copied = 0 if broker_factory.slack else 1

    unsettled = consumer.dead_letter_many(letters)
    assert [(d.body, type(e)) for d, e in unsettled] == [
        (f"bad-{i}".encode(), BackPressureError) for i in range(copied, 3)
    ]
    outcomes = dead_letter_many_safely(consumer, letters[copied:])
    assert outcomes == [Rejected.WITHOUT_REASON] * (3 - copied)
    assert consumer.get(QUIET) is None  # none requeued
    assert consumer.queue_depth(control.name) == 0
    if copied:
        (copy,) = dead_letters(broker_factory, refusing, 1)
        assert (copy.body, copy.headers[REASON_HEADER]) == (b"bad-0", "bad")
    else:
        assert [c.body for c in dead_letters(broker_factory, refusing, 2)] == fillers


def test_full_queue_pushes_back_until_drained(broker_factory: BrokerFactory) -> None:
    broker = broker_factory()
    spec = broker_factory.spec("bounded", max_length=3)
    broker.declare([spec])
    taken = 3 + broker_factory.slack
    for index in range(taken):
        broker.publish(CONTROL_EXCHANGE, spec.routing_key, f"m{index}".encode())

    with pytest.raises(BackPressureError, match=spec.name):
        broker.publish(CONTROL_EXCHANGE, spec.routing_key, b"refused")
    assert broker.queue_depth(spec.name) == taken

    broker.subscribe(spec.name, prefetch=taken)
    drained = receive(broker, taken)
    for delivery in drained:
        broker.ack(delivery)
    broker.publish(CONTROL_EXCHANGE, spec.routing_key, b"after")
    (after,) = receive(broker)

    assert [d.body for d in drained] == [f"m{i}".encode() for i in range(taken)]
    assert after.body == b"after"  # the refused one was not queued
    broker.ack(after)


def test_byte_bound_pushes_back(broker_factory: BrokerFactory) -> None:
    broker = broker_factory()
    spec = broker_factory.spec("bytes", max_length_bytes=100)
    broker.declare([spec])
    broker.publish(CONTROL_EXCHANGE, spec.routing_key, b"a" * 60)
    broker.publish(CONTROL_EXCHANGE, spec.routing_key, b"b" * 40)  # exactly at the bound
    for _ in range(broker_factory.slack):
        broker.publish(CONTROL_EXCHANGE, spec.routing_key, b"c")  # not yet over it

    with pytest.raises(BackPressureError):
        broker.publish(CONTROL_EXCHANGE, spec.routing_key, b"d")
    assert broker.queue_depth(spec.name) == 2 + broker_factory.slack


def test_unroutable_mandatory_publish_is_refused(broker_factory: BrokerFactory) -> None:
    broker = broker_factory()
    spec = broker_factory.spec("work", exchange=SMASHED_EXCHANGE)
    broker.declare([spec])

    with pytest.raises(UnroutableError):
        broker.publish(SMASHED_EXCHANGE, f"{broker_factory.job}.nowhere", b"lost?")

    broker.publish(SMASHED_EXCHANGE, spec.routing_key, b"found")
    assert broker.queue_depth(spec.name) == 1


def test_unknown_exchange_is_a_broker_error_and_the_handle_survives(
    broker_factory: BrokerFactory,
) -> None:
    broker = broker_factory()
    spec = broker_factory.spec("work")
    broker.declare([spec])
    broker.publish(CONTROL_EXCHANGE, spec.routing_key, b"before")
    broker.subscribe(spec.name, prefetch=1)
    (held,) = receive(broker)

    with pytest.raises(BrokerError, match="no exchange"):
        broker.publish(f"{broker_factory.job}.no-such-exchange", "key", b"x")

    broker.ack(held)  # the failed publish did not void deliveries in hand
    broker.publish(CONTROL_EXCHANGE, spec.routing_key, b"after")
    (after,) = receive(broker)
    assert after.body == b"after"
    broker.ack(after)


def test_redeclaring_with_other_arguments_is_a_broker_error(
    broker_factory: BrokerFactory,
) -> None:
    broker = broker_factory()
    spec = broker_factory.spec("work", max_length=5)
    broker.declare([spec])
    clash = QueueSpec(spec.name, spec.exchange, spec.routing_key, max_length=6)

    with pytest.raises(BrokerError, match="inequivalent"):
        broker_factory().declare([clash])

    broker.declare([spec])  # the original declaration still stands
    broker.publish(CONTROL_EXCHANGE, spec.routing_key, b"ok")
    assert broker.queue_depth(spec.name) == 1


@pytest.mark.parametrize("leave", ["close", "unsubscribe"])
def test_single_active_consumer_fails_over(broker_factory: BrokerFactory, leave: str) -> None:
    spec = broker_factory.spec("shard", single_active_consumer=True)
    first, second = broker_factory(), broker_factory()
    first.declare([spec])
    for index in range(4):
        first.publish(CONTROL_EXCHANGE, spec.routing_key, f"m{index}".encode())
    first.subscribe(spec.name, prefetch=2)
    m0, m1 = receive(first, 2)
    second.declare([spec])  # as every role declares its queues: so it knows this one's kind
    second.subscribe(spec.name, prefetch=2)

    assert second.get(QUIET) is None  # standby while the first consumer is active
    first.ack(m0)
    if leave == "close":
        first.close()
    else:
        first.unsubscribe(spec.name)

    taken_over = receive(second, 2)
    second.ack(taken_over[0])
    taken_over += receive(second, 1)
    for delivery in taken_over[1:]:
        second.ack(delivery)
    assert second.get(QUIET) is None

    by_body = {d.body: d for d in taken_over}
    assert sorted(by_body) == [b"m1", b"m2", b"m3"]
    assert by_body[b"m1"].redelivered  # it was in the first consumer's hands
    assert (m0.body, m1.body) == (b"m0", b"m1")
    if not broker_factory.quorum:
        # The queue's order holds across the take-over: what the first consumer held comes
        # back ahead of what it never had, so a client's batches reach the new holder in order.
        # A quorum queue removes a leaving consumer before it takes back what it held, so a
        # successor can be served newer messages first (docs/reliability.md, "Cluster chaos").
        assert [d.body for d in taken_over] == [b"m1", b"m2", b"m3"]


@pytest.mark.parametrize("leave", ["close", "unsubscribe"])
def test_a_successor_waiting_on_a_single_active_consumer_gets_the_queue_in_order(
    broker_factory: BrokerFactory, leave: str
) -> None:
    # The successor subscribes while the first consumer still holds messages (a worker that
    # took over a shard's lease while the old holder was cut off), then the first one goes.
    spec = broker_factory.spec("shard", single_active_consumer=True)
    first, successor = broker_factory(), broker_factory()
    first.declare([spec])
    for index in range(10):
        first.publish(CONTROL_EXCHANGE, spec.routing_key, f"m{index}".encode())
    first.subscribe(spec.name, prefetch=4)
    held = receive(first, 4)
    successor.declare([spec])
    successor.subscribe(spec.name, prefetch=20)
    assert successor.get(QUIET) is None

    if leave == "close":
        first.close()
    else:
        first.unsubscribe(spec.name)
    taken_over = receive(successor, 10)
    for delivery in taken_over:
        successor.ack(delivery)

    assert [d.body for d in held] == [f"m{i}".encode() for i in range(4)]
    expected = [f"m{i}".encode() for i in range(10)]
    got = [d.body for d in taken_over]
    assert (sorted(got) if broker_factory.quorum else got) == expected  # see above
    redelivered = {d.body for d in taken_over if d.redelivered}
    assert redelivered == set(expected[:4])


def test_competing_consumers_share_a_plain_queue(broker_factory: BrokerFactory) -> None:
    spec = broker_factory.spec("work")
    one, two = broker_factory(), broker_factory()
    one.declare([spec])
    for index in range(4):
        one.publish(CONTROL_EXCHANGE, spec.routing_key, f"m{index}".encode())
    one.subscribe(spec.name, prefetch=1)
    two.subscribe(spec.name, prefetch=1)

    (a,) = receive(one)
    (b,) = receive(two)

    assert a.body != b.body
    one.ack(a)
    two.ack(b)


def test_prefetch_bounds_unacknowledged_deliveries(broker_factory: BrokerFactory) -> None:
    broker = broker_factory()
    spec = broker_factory.spec("work")
    broker.declare([spec])
    for index in range(5):
        broker.publish(CONTROL_EXCHANGE, spec.routing_key, f"m{index}".encode())
    broker.subscribe(spec.name, prefetch=2)

    held = receive(broker, 2)
    assert broker.get(QUIET) is None  # a third would exceed the prefetch
    broker.ack(held[0])
    (third,) = receive(broker)
    assert broker.get(QUIET) is None

    assert [d.body for d in [*held, third]] == [b"m0", b"m1", b"m2"]
    for delivery in (held[1], third):
        broker.ack(delivery)


def test_fanout_event_reaches_every_subscriber(broker_factory: BrokerFactory) -> None:
    left = broker_factory.spec("events.left", exchange=EVENTS_EXCHANGE)
    right = broker_factory.spec("events.right", exchange=EVENTS_EXCHANGE)
    alice, bob = broker_factory(), broker_factory()
    alice.declare([left])
    bob.declare([right])
    alice.subscribe(left.name, prefetch=1)
    bob.subscribe(right.name, prefetch=1)
    event = f"{broker_factory.job}: version 3 published".encode()

    alice.publish(EVENTS_EXCHANGE, "", event)

    for broker in (alice, bob):
        (delivery,) = receive(broker)
        assert delivery.body == event
        broker.ack(delivery)


def test_events_are_best_effort_without_subscribers(broker_factory: BrokerFactory) -> None:
    broker = broker_factory()
    broker.declare([])
    # Nobody listens (in memory; on a shared RabbitMQ maybe someone else does): not an error.
    broker.publish(EVENTS_EXCHANGE, "", b"job finished")
    # Work queues stay mandatory.
    with pytest.raises(UnroutableError):
        broker.publish(CONTROL_EXCHANGE, f"{broker_factory.job}.nobody", b"x")


def test_oversize_body_is_refused_before_sending(broker_factory: BrokerFactory) -> None:
    broker = broker_factory(max_message_bytes=1024)
    spec = broker_factory.spec("work")
    broker.declare([spec])

    with pytest.raises(MessageTooLargeError, match="1025 bytes"):
        broker.publish(CONTROL_EXCHANGE, spec.routing_key, b"x" * 1025)

    broker.publish(CONTROL_EXCHANGE, spec.routing_key, b"x" * 1024)
    assert broker.queue_depth(spec.name) == 1


@pytest.mark.parametrize("body", [bytearray(b"abc"), memoryview(b"abc")])
def test_only_bytes_bodies_are_accepted(broker_factory: BrokerFactory, body: Any) -> None:
    broker = broker_factory()
    spec = broker_factory.spec("work")
    broker.declare([spec])

    with pytest.raises(TypeError, match="body must be bytes"):
        broker.publish(CONTROL_EXCHANGE, spec.routing_key, body)

    assert broker.queue_depth(spec.name) == 0


def test_settling_twice_or_after_unsubscribe(broker_factory: BrokerFactory) -> None:
    broker = broker_factory()
    spec = broker_factory.spec("work")
    broker.declare([spec])
    broker.publish(CONTROL_EXCHANGE, spec.routing_key, b"once")
    broker.publish(CONTROL_EXCHANGE, spec.routing_key, b"returned")
    broker.subscribe(spec.name, prefetch=2)
    once, returned = receive(broker, 2)

    broker.ack(once)
    with pytest.raises(BrokerError, match="not outstanding") as excinfo:
        broker.ack(once)
    assert not isinstance(excinfo.value, StaleDeliveryError)

    broker.unsubscribe(spec.name)
    with pytest.raises(StaleDeliveryError):
        broker.ack(returned)
    other = broker_factory()
    other.subscribe(spec.name, prefetch=1)
    (again,) = receive(other)
    assert (again.body, again.redelivered) == (b"returned", True)
    other.ack(again)


def test_unsubscribing_one_queue_leaves_the_others_flowing(broker_factory: BrokerFactory) -> None:
    broker = broker_factory()
    left, right = broker_factory.spec("left"), broker_factory.spec("right")
    broker.declare([left, right])
    broker.subscribe(left.name, prefetch=2)
    broker.subscribe(right.name, prefetch=2)
    broker.publish(CONTROL_EXCHANGE, left.routing_key, b"left-1")
    (held,) = receive(broker)

    broker.unsubscribe(left.name)
    broker.publish(CONTROL_EXCHANGE, left.routing_key, b"left-2")
    broker.publish(CONTROL_EXCHANGE, right.routing_key, b"right-1")

    (delivery,) = receive(broker)
    assert delivery.body == b"right-1"
    broker.ack(delivery)
    assert broker.get(QUIET) is None
    assert held.body == b"left-1"
    assert broker.queue_depth(left.name) == 2  # the returned one and the new one


def test_missing_queues(broker_factory: BrokerFactory) -> None:
    broker = broker_factory()
    missing = f"{broker_factory.job}.never-declared"

    with pytest.raises(BrokerError, match="no queue"):
        broker.queue_depth(missing)
    with pytest.raises(BrokerError, match="no queue"):
        broker.subscribe(missing, prefetch=1)
    broker.delete_queue(missing)  # idempotent

    spec = broker_factory.spec("work")
    broker.declare([spec])
    broker.delete_queue(spec.name)
    with pytest.raises(BrokerError):
        broker.queue_depth(spec.name)


def test_closed_handle_refuses_work(broker_factory: BrokerFactory) -> None:
    broker = broker_factory()
    spec = broker_factory.spec("work")
    broker.declare([spec])
    broker.publish(CONTROL_EXCHANGE, spec.routing_key, b"x")
    broker.subscribe(spec.name, prefetch=1)
    (held,) = receive(broker)
    broker.close()

    with pytest.raises(BrokerError, match="closed"):
        broker.get(0)
    with pytest.raises(BrokerError, match="closed"):
        broker.publish(CONTROL_EXCHANGE, spec.routing_key, b"y")
    with pytest.raises(BrokerError, match="closed"):
        broker.ack(held)
    broker.close()  # idempotent


# -- RabbitMQ only: batched dead letters on a lost connection, by nack, without configure ------

rabbitmqctl = rabbit.rabbitmqctl  # the fixture (skips locally / fails under CI without it)


def open_rabbit(amqp_url: str, name: str, **settings: Any) -> RabbitMQBroker:
    options = RabbitMQOptions(give_up_after=20.0, connection_name=name, **settings)
    return RabbitMQBroker(amqp_url, options)


@pytest.mark.rabbitmq
def test_rabbitmq_dead_letter_many_on_a_lost_connection_copies_nothing(
    amqp_url: str, job: str, rabbitmqctl: Callable[..., str]
) -> None:
    dead, control = dead_queue(job), control_queue(job)
    consumer = open_rabbit(amqp_url, f"{job}-consumer")
    try:
        consumer.declare([dead, control])
        for index in range(3):
            consumer.publish(CONTROL_EXCHANGE, control.routing_key, f"junk-{index}".encode())
        consumer.subscribe(control.name, prefetch=3)
        letters = [(d, "bad") for d in receive(consumer, 3)]
        rabbit.kill_connection(rabbitmqctl, consumer.connection_name)

        assert dead_letter_many_safely(consumer, letters) == [Rejected.REDELIVERED] * 3

        assert consumer.queue_depth(dead.name) == 0  # no copy of a message coming back
        again = receive(consumer, 3)
        assert sorted(d.body for d in again) == [b"junk-0", b"junk-1", b"junk-2"]
        assert all(d.redelivered for d in again)
        assert consumer.dead_letter_many([(d, "bad") for d in again]) == []
        assert consumer.queue_depth(dead.name) == 3
    finally:
        consumer.delete_queue(control.name)
        consumer.delete_queue(dead.name)
        consumer.close()


@pytest.mark.rabbitmq
def test_rabbitmq_dead_letter_many_by_nack_and_without_configure_permission(
    amqp_url: str, job: str, caplog: pytest.LogCaptureFixture
) -> None:
    dead, control = dead_queue(job), control_queue(job)
    operator = open_rabbit(amqp_url, f"{job}-operator")
    by_nack = open_rabbit(amqp_url, f"{job}-client", dead_letter_by_nack=True)
    passive = open_rabbit(amqp_url, f"{job}-passive", passive_declare=True)
    try:
        operator.declare([dead, control])
        by_nack.declare([dead, control])
        passive.declare([dead, control])
        for index in range(4):
            operator.publish(CONTROL_EXCHANGE, control.routing_key, f"junk-{index}".encode())
        # A client user without write permission on splitmq.dead: RabbitMQ's routing moves
        # them (x-death); the reasons go to one log line.
        by_nack.subscribe(control.name, prefetch=2)
        caplog.set_level(logging.WARNING, logger="splitmq.broker")
        letters = [(d, f"impostor: c{i}") for i, d in enumerate(receive(by_nack, 2))]
        assert dead_letter_many_safely(by_nack, letters) == [Rejected.DEAD_LETTERED] * 2
        assert any("impostor: c0; impostor: c1" in r.getMessage() for r in caplog.records)
        by_nack.unsubscribe(control.name)
        # A handle that cannot declare `<job>.dead` again: rejected by nack, never requeued.
        operator.delete_queue(dead.name)
        passive.subscribe(control.name, prefetch=2)
        letters = [(d, "undecodable") for d in receive(passive, 2)]
        assert dead_letter_many_safely(passive, letters) == [Rejected.WITHOUT_REASON] * 2
        assert passive.get(QUIET) is None
        assert operator.queue_depth(control.name) == 0
    finally:
        operator.delete_queue(control.name)
        operator.delete_queue(dead.name)
        for handle in (operator, by_nack, passive):
            handle.close()


def test_confirm_later_returns_at_once_and_hands_back_refusals(
    broker_factory: BrokerFactory,
) -> None:
    job = broker_factory.job
    spec = broker_factory.track(control_queue(job, QueueLimits(control_max_length=2)))
    broker = broker_factory()
    broker.declare([spec])
    later = PublishOptions(message_id="m", confirm_later=True)
    # Filled with confirmed publishes: a quorum queue refuses only once it knows it is over
    # its bound, and pipelined publishes could all pass before it does.
    taken = [f"m{i}".encode() for i in range(2 + broker_factory.slack)]
    for body in taken:
        broker.publish(CONTROL_EXCHANGE, spec.routing_key, body)
    broker.publish(CONTROL_EXCHANGE, spec.routing_key, b"three", later)
    broker.publish(CONTROL_EXCHANGE, f"{job}.nobody", b"lost", later)
    refused: list[Refused] = []
    deadline = time.monotonic() + 10.0
    while len(refused) < 2 and time.monotonic() < deadline:
        refused += broker.refused()
        time.sleep(0.01)
    got = [(r.routing_key, r.body, type(r.error), r.options) for r in refused]
    assert got == [
        (spec.routing_key, b"three", BackPressureError, later),
        (f"{job}.nobody", b"lost", UnroutableError, later),
    ]
    assert broker.refused() == []
    assert broker.queue_depth(spec.name) == len(taken)
