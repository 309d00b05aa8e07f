"""The RabbitMQ broker's two fast paths, on a real server (docs/benchmarks.md, SFL-V2 section).

- Frames read and written with one copy of the body (`broker.pika_frames.tune_frames`):
  pika reads 4 KiB per `recv` and copies a body several times unless told otherwise. Checked:
  a real connection takes the patch, and multi-frame bodies, cut anywhere by the reads, still
  arrive byte for byte (tests/unit/test_pika_frames.py pins the pika versions and compares
  the frames with pika's own).
- `publish(..., persistent=False)`: the message goes out with delivery mode 1, still confirmed
  and mandatory. Checked on the wire with a raw pika `basic_get`.
- Batched dead letters wait for all their copies' confirms with pika's own (private) wait,
  `BlockingConnection._flush_output`, and without it by polling: both checked.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pika
import pytest

from broker.errors import UnroutableError
from broker.pika_frames import RECV_BYTES, tune_frames
from broker.rabbitmq import RabbitMQBroker
from broker.topology import CONTROL_EXCHANGE, control_queue, dead_queue
from broker.transport import PublishOptions, QueueSpec

pytestmark = pytest.mark.rabbitmq


@pytest.fixture
def queue(amqp_url: str, job: str) -> Iterator[QueueSpec]:
    spec = QueueSpec(name=f"{job}.recv", exchange=CONTROL_EXCHANGE, routing_key=f"{job}.recv")
    with RabbitMQBroker(amqp_url) as admin:
        admin.declare([spec])
        yield spec
        admin.delete_queue(spec.name)


def test_a_real_connection_gets_the_frame_reader_and_writer(amqp_url: str) -> None:
    connection = pika.BlockingConnection(pika.URLParameters(amqp_url))
    try:
        assert tune_frames(connection)
        assert connection._impl._transport._MAX_RECV_BYTES == RECV_BYTES
        channel = connection.channel()  # frames both ways through the replacements
        assert channel.queue_declare("", exclusive=True).method.queue
    finally:
        connection.close()


def test_multi_frame_bodies_arrive_intact(amqp_url: str, queue: QueueSpec) -> None:
    # 3 MiB + a few bytes spans ~25 frames and ends mid-frame; the small ones share reads.
    bodies = [os.urandom(3 * 2**20 + 13), b"x", os.urandom(200_000), b""]
    with RabbitMQBroker(amqp_url) as producer, RabbitMQBroker(amqp_url) as consumer:
        consumer.subscribe(queue.name, prefetch=8)
        for body in bodies:
            producer.publish(queue.exchange, queue.routing_key, body)
        received = []
        for _ in bodies:
            delivery = consumer.get(10.0)
            assert delivery is not None
            received.append(delivery.body)
            consumer.ack(delivery)
    assert received == bodies


def _delivery_mode(amqp_url: str, queue: str) -> int:
    connection = pika.BlockingConnection(pika.URLParameters(amqp_url))
    try:
        method, properties, _body = connection.channel().basic_get(queue, auto_ack=True)
        assert method is not None, f"nothing in {queue}"
        mode: int = properties.delivery_mode
        return mode
    finally:
        connection.close()


def test_publish_is_persistent_unless_asked_not_to_be(amqp_url: str, queue: QueueSpec) -> None:
    with RabbitMQBroker(amqp_url) as producer:
        producer.publish(queue.exchange, queue.routing_key, b"kept")
        assert _delivery_mode(amqp_url, queue.name) == 2
        producer.publish(
            queue.exchange, queue.routing_key, b"ephemeral", PublishOptions(persistent=False)
        )
        assert _delivery_mode(amqp_url, queue.name) == 1


def test_transient_publish_is_still_mandatory(amqp_url: str, job: str) -> None:
    with RabbitMQBroker(amqp_url) as producer:
        producer.declare([])
        with pytest.raises(UnroutableError):
            producer.publish(
                CONTROL_EXCHANGE, f"{job}.nobody", b"x", PublishOptions(persistent=False)
            )


class _WithoutWait:
    """A pika connection as one would be whose BlockingConnection has no `_flush_output`."""

    def __init__(self, connection: Any) -> None:
        self.__dict__["_inner"] = connection

    def __getattr__(self, name: str) -> Any:
        if name == "_flush_output":
            raise AttributeError(name)
        return getattr(self.__dict__["_inner"], name)


def test_batched_dead_letters_are_confirmed_with_and_without_pikas_wait(
    amqp_url: str, job: str
) -> None:
    assert callable(getattr(pika.BlockingConnection, "_flush_output", None))  # pika's, still
    dead, control = dead_queue(job), control_queue(job)
    with RabbitMQBroker(amqp_url) as broker:
        broker.declare([dead, control])
        try:
            broker.subscribe(control.name, prefetch=3)
            for round_ in range(2):
                for index in range(3):
                    body = f"junk-{round_}-{index}".encode()
                    broker.publish(CONTROL_EXCHANGE, control.routing_key, body)
                deliveries = [broker.get(5) for _ in range(3)]
                assert all(d is not None for d in deliveries)
                keeper: Any = broker._keeper
                if round_ == 1:
                    keeper.connection = _WithoutWait(keeper.connection)
                letters = [(d, "bad") for d in deliveries if d is not None]
                assert broker.dead_letter_many(letters) == []
                assert not keeper._dead.sent  # every copy confirmed before the originals' acks
                assert broker.queue_depth(dead.name) == 3 * (round_ + 1)
            assert broker.queue_depth(control.name) == 0
        finally:
            broker.delete_queue(control.name)
            broker.delete_queue(dead.name)
