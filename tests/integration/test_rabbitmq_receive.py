"""Frame-sized socket reads (`broker.rabbitmq_connection.tune_receive`) on a real connection.

pika reads 4 KiB per `recv` unless told otherwise; the broker raises that to one frame. These
tests check that the pika internals it relies on are still there (a canary for pika upgrades)
and that multi-frame bodies still arrive byte for byte.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pika
import pytest

from broker.rabbitmq import RabbitMQBroker
from broker.rabbitmq_connection import CONSUME_BYTES_PER_EVENT, tune_receive
from broker.topology import CONTROL_EXCHANGE
from broker.transport import QueueSpec

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
