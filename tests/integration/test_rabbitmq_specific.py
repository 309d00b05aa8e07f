"""RabbitMQ-only behaviour: reconnects, stale deliveries, channel errors, credentials, doctor.

The server kills connections through ``rabbitmqctl close_connection``, aimed at one connection by
its ``connection_name`` client property: other tests share the server and must not notice.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

import pytest

from broker.errors import BrokerError, BrokerUnavailableError, StaleDeliveryError
from broker.rabbitmq import RabbitMQBroker, RabbitMQOptions
from broker.topology import CONTROL_EXCHANGE
from broker.transport import QueueSpec

pytestmark = pytest.mark.rabbitmq

WAIT = 5.0
QUIET = 0.3


@pytest.fixture(scope="session")
def rabbitmqctl(amqp_url: str) -> Callable[..., str]:
    """Runs rabbitmqctl against the test server (skip locally / fail under CI when absent)."""
    path = shutil.which("rabbitmqctl")
    if path is None:
        message = "rabbitmqctl is not installed; it is needed to kill connections server-side"
        if os.environ.get("CI", "").lower() in {"1", "true", "yes"}:
            pytest.fail(message)
        pytest.skip(f"{message} (under CI=true this fails instead)")

    def run(*args: str) -> str:
        done = subprocess.run([path, *args], capture_output=True, text=True, timeout=60, check=True)
        return done.stdout

    return run


def kill_connection(rabbitmqctl: Callable[..., str], connection_name: str) -> None:
    """Close the server side of the one connection that carries `connection_name`."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        # The table format: its pids are the syntax close_connection accepts (the JSON one's
        # "#PID<...>" are not).
        listing = rabbitmqctl(
            "list_connections", "pid", "client_properties", "--quiet", "--no-table-headers"
        )
        marker = f'{{"connection_name","{connection_name}"}}'
        pids = [line.split("\t", 1)[0] for line in listing.splitlines() if marker in line]
        if pids:
            for pid in pids:
                rabbitmqctl("close_connection", pid, "splitmq test: simulated broker restart")
            return
        time.sleep(0.2)  # the server lists a new connection with a short delay
    raise AssertionError(f"connection {connection_name!r} never showed up in rabbitmqctl")


@pytest.fixture
def open_broker(amqp_url: str, job: str) -> Iterator[Callable[..., RabbitMQBroker]]:
    handles: list[RabbitMQBroker] = []

    def open_(name: str = "main", **options: Any) -> RabbitMQBroker:
        settings = RabbitMQOptions(
            give_up_after=20.0,
            connection_name=f"{job}-{name}",
            **options,
        )
        handle = RabbitMQBroker(amqp_url, settings)
        handles.append(handle)
        return handle

    yield open_
    for handle in handles:
        handle.close()


def work_queue(job: str, suffix: str = "work", **options: Any) -> QueueSpec:
    name = f"{job}.{suffix}"
    return QueueSpec(name=name, exchange=CONTROL_EXCHANGE, routing_key=name, **options)


def test_reconnects_redeclares_and_voids_old_deliveries(
    open_broker: Callable[..., RabbitMQBroker], rabbitmqctl: Callable[..., str], job: str
) -> None:
    broker = open_broker()
    durable = work_queue(job)
    # Exclusive and auto-deleted: it dies with the connection, so only a re-declare revives it.
    private = work_queue(job, "private", durable=False, exclusive=True, auto_delete=True)
    broker.declare([durable, private])
    broker.publish(CONTROL_EXCHANGE, durable.routing_key, b"in flight", message_id="f-1")
    broker.subscribe(durable.name, prefetch=1)
    held = broker.get(WAIT)
    assert held is not None and not held.redelivered
    try:
        kill_connection(rabbitmqctl, broker.connection_name)

        # Publishing notices the dead connection, reconnects, re-declares, and retries.
        broker.publish(CONTROL_EXCHANGE, private.routing_key, b"after the restart")
        assert broker.connects == 2
        with pytest.raises(StaleDeliveryError):
            broker.ack(held)

        # The subscription was restored and the unacked message came back.
        again = broker.get(WAIT)
        assert again is not None
        assert (again.body, again.message_id, again.redelivered) == (b"in flight", "f-1", True)
        assert again.generation > held.generation
        broker.ack(again)
        broker.subscribe(private.name, prefetch=1)
        fresh = broker.get(WAIT)
        assert fresh is not None and fresh.body == b"after the restart"
        broker.ack(fresh)
    finally:
        broker.delete_queue(durable.name)


def test_consumer_reconnects_while_waiting(
    open_broker: Callable[..., RabbitMQBroker], rabbitmqctl: Callable[..., str], job: str
) -> None:
    consumer, publisher = open_broker("consumer"), open_broker("publisher")
    spec = work_queue(job)
    consumer.declare([spec])
    consumer.subscribe(spec.name, prefetch=1)
    try:
        kill_connection(rabbitmqctl, consumer.connection_name)
        publisher.publish(CONTROL_EXCHANGE, spec.routing_key, b"while you were away")

        delivery = consumer.get(WAIT)
        assert delivery is not None and delivery.body == b"while you were away"
        consumer.ack(delivery)
        assert consumer.connects == 2
        assert publisher.connects == 1  # the other connection was left alone
    finally:
        publisher.delete_queue(spec.name)


def test_channel_error_raises_without_reconnecting(
    open_broker: Callable[..., RabbitMQBroker], job: str
) -> None:
    broker = open_broker()
    spec = work_queue(job, max_length=5)
    broker.declare([spec])
    broker.publish(CONTROL_EXCHANGE, spec.routing_key, b"held")
    broker.subscribe(spec.name, prefetch=1)
    held = broker.get(WAIT)
    assert held is not None
    try:
        with pytest.raises(BrokerError, match="PRECONDITION_FAILED") as excinfo:
            broker.declare([replace(spec, max_length=6)])

        assert not isinstance(excinfo.value, BrokerUnavailableError)
        assert broker.connects == 1  # a channel error is a bug, not an outage
        broker.ack(held)  # it closed the publisher channel only; deliveries in hand are fine
        broker.publish(CONTROL_EXCHANGE, spec.routing_key, b"still works")
        delivery = broker.get(WAIT)
        assert delivery is not None and delivery.body == b"still works"
        broker.ack(delivery)
    finally:
        broker.delete_queue(spec.name)


def test_queue_deleted_under_a_consumer_cancels_the_subscription(
    open_broker: Callable[..., RabbitMQBroker], job: str
) -> None:
    consumer, operator = open_broker("consumer"), open_broker("operator")
    spec = work_queue(job)
    consumer.declare([spec])
    consumer.subscribe(spec.name, prefetch=1)

    operator.delete_queue(spec.name)

    assert consumer.get(QUIET) is None
    consumer.unsubscribe(spec.name)  # already cancelled by the server: a no-op, not an error
    consumer.declare([spec])
    consumer.subscribe(spec.name, prefetch=1)
    operator.publish(CONTROL_EXCHANGE, spec.routing_key, b"new life")
    delivery = consumer.get(WAIT)
    assert delivery is not None and delivery.body == b"new life"
    consumer.ack(delivery)
    consumer.delete_queue(spec.name)


def test_wrong_password_fails_fast_without_retrying(amqp_url: str, job: str) -> None:
    sleeps: list[float] = []
    bad_url = amqp_url.replace("guest:guest@", "guest:not-the-password@", 1)
    assert bad_url != amqp_url, "test expects the default guest credentials in the URL"

    with pytest.raises(BrokerError, match="refused user 'guest'") as excinfo:
        RabbitMQBroker(bad_url, RabbitMQOptions(connection_name=f"{job}-bad"), sleep=sleeps.append)

    assert not isinstance(excinfo.value, BrokerUnavailableError)
    assert sleeps == []


def test_server_info_reports_product_and_working_probe(
    open_broker: Callable[..., RabbitMQBroker],
) -> None:
    info = open_broker().server_info()

    assert info.product == "RabbitMQ"
    assert info.version.split(".")[0].isdigit()
    assert (info.can_declare, info.can_publish, info.detail) == (True, True, "")
