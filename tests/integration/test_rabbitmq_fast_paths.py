"""The RabbitMQ broker's two fast paths, on a real server (docs/benchmarks.md, SFL-V2 section).

- Frame-sized socket reads (`broker.rabbitmq_connection.tune_receive`): pika reads 4 KiB per
  `recv` unless told otherwise. Checked: the pika internals it relies on are still there (a
  canary for pika upgrades) and multi-frame bodies still arrive byte for byte.
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
from broker.rabbitmq_connection import CONSUME_BYTES_PER_EVENT, tune_receive
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


def test_a_real_connection_gets_frame_sized_reads(amqp_url: str) -> None:
    connection = pika.BlockingConnection(pika.URLParameters(amqp_url))
    try:
        assert tune_receive(connection)
        transport = connection._impl._transport
        frame_max = connection._impl.params.frame_max
        assert transport._MAX_RECV_BYTES == frame_max + 8
        assert transport._MAX_CONSUME_BYTES == max(CONSUME_BYTES_PER_EVENT, frame_max + 8)
    finally:
        connection.close()


def test_tune_receive_leaves_unknown_objects_alone() -> None:
    class Stranger:
        pass

    assert not tune_receive(Stranger())


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
