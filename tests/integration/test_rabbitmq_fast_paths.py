"""The RabbitMQ broker's two fast paths, on a real server (docs/benchmarks.md, SFL-V2 section).

- Frames read and written with one copy of the body (`broker.rabbitmq_channels.tune_frames`):
  pika reads 4 KiB per `recv` and copies a body several times unless told otherwise. Checked:
  the pika internals it relies on are still there (a canary for pika upgrades) and multi-frame
  bodies, cut anywhere by the reads, still arrive byte for byte.
- `publish(..., persistent=False)`: the message goes out with delivery mode 1, still confirmed
  and mandatory. Checked on the wire with a raw pika `basic_get`.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pika
import pytest

from broker.errors import UnroutableError
from broker.rabbitmq import RabbitMQBroker
from broker.rabbitmq_channels import RECV_BYTES, tune_frames
from broker.topology import CONTROL_EXCHANGE
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


def test_tune_frames_leaves_unknown_objects_alone() -> None:
    class Stranger:
        pass

    assert not tune_frames(Stranger())


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
