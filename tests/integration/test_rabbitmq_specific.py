"""RabbitMQ-only behaviour: reconnects, stale deliveries, channel errors, credentials, doctor,
dead-lettering without the dead-letter exchange.

The server kills connections through ``rabbitmqctl close_connection``, aimed at one connection by
its ``connection_name`` client property: other tests share the server and must not notice.
"""

from __future__ import annotations

import logging
import os
import random
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

import pytest

from broker.errors import BrokerError, BrokerUnavailableError, StaleDeliveryError
from broker.rabbitmq import RabbitMQBroker, RabbitMQOptions
from broker.rejection import Rejected, dead_letter_safely
from broker.topology import CONTROL_EXCHANGE, control_queue, dead_queue
from broker.transport import REASON_HEADER, PublishOptions, QueueSpec

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
    broker.publish(
        CONTROL_EXCHANGE, durable.routing_key, b"in flight", PublishOptions(message_id="f-1")
    )
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


def test_a_confirm_later_publish_cut_off_by_an_outage_is_refused_not_lost(
    open_broker: Callable[..., RabbitMQBroker], rabbitmqctl: Callable[..., str], job: str
) -> None:
    broker = open_broker()
    queue = work_queue(job)
    broker.declare([queue])
    later = PublishOptions(persistent=False, confirm_later=True)
    try:
        for i in range(20):
            broker.publish(CONTROL_EXCHANGE, queue.routing_key, b"%d" % i, later)
        kill_connection(rabbitmqctl, broker.connection_name)
        time.sleep(0.5)  # the server's close is on the socket, confirms of some before it
        refused = broker.refused()  # notices the closed connection, or takes the confirms
        broker.publish(CONTROL_EXCHANGE, queue.routing_key, b"after", later)  # reconnects
        refused += broker.refused()
        assert all(isinstance(r.error, BrokerUnavailableError) for r in refused)
        # Every one arrived or was handed back: at least once, never silently dropped.
        arrived = set()
        broker.subscribe(queue.name, prefetch=100)
        while (delivery := broker.get(1.0)) is not None:
            arrived.add(delivery.body)
            broker.ack(delivery)
        assert b"after" in arrived
        assert {b"%d" % i for i in range(20)} <= arrived | {r.body for r in refused}
    finally:
        broker.delete_queue(queue.name)


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


def test_an_outage_logs_one_warning_and_says_reconnected(
    open_broker: Callable[..., RabbitMQBroker],
    rabbitmqctl: Callable[..., str],
    job: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    broker = open_broker()
    spec = work_queue(job)
    broker.declare([spec])
    try:
        caplog.set_level(logging.INFO, logger="splitmq.broker")
        kill_connection(rabbitmqctl, broker.connection_name)
        broker.publish(CONTROL_EXCHANGE, spec.routing_key, b"after the outage")
        assert broker.connects == 2

        ours = [r for r in caplog.records if r.name == "splitmq.broker"]
        assert [r.levelno for r in ours] == [logging.WARNING, logging.INFO], ours
        lost, back = (r.getMessage() for r in ours)
        assert "lost the connection to RabbitMQ at" in lost and "retrying" in lost
        assert "CONNECTION_FORCED" in lost  # what happened, in one line
        assert back.startswith("reconnected to RabbitMQ at") and " after " in back
        assert not any(r.exc_info for r in ours)  # no traceback per attempt
    finally:
        broker.delete_queue(spec.name)


def test_dead_letter_falls_back_to_nack_when_the_dead_queue_cannot_come_back(
    open_broker: Callable[..., RabbitMQBroker], job: str
) -> None:
    # A handle without configure permission (passive_declare) cannot declare `<job>.dead`
    # again: the message must still leave its queue (no poison loop) and the consumer go on.
    dead, control = dead_queue(job), control_queue(job)
    operator = open_broker("operator")
    operator.declare([dead, control])
    consumer = open_broker("consumer", passive_declare=True)
    consumer.declare([dead, control])
    operator.delete_queue(dead.name)
    try:
        operator.publish(CONTROL_EXCHANGE, control.routing_key, b"\xc1 junk")
        operator.publish(CONTROL_EXCHANGE, control.routing_key, b"good")
        consumer.subscribe(control.name, prefetch=1)
        junk = consumer.get(WAIT)
        assert junk is not None

        assert dead_letter_safely(consumer, junk, "undecodable") is Rejected.WITHOUT_REASON
        good = consumer.get(WAIT)
        assert good is not None and good.body == b"good"  # not the junk again
        consumer.ack(good)
        assert consumer.get(QUIET) is None
        assert operator.queue_depth(control.name) == 0
    finally:
        operator.delete_queue(control.name)
        operator.delete_queue(dead.name)


def test_dead_letter_by_nack_leaves_it_to_the_queue_routing(
    open_broker: Callable[..., RabbitMQBroker], job: str, caplog: pytest.LogCaptureFixture
) -> None:
    # For a client user that may not publish to splitmq.dead: RabbitMQ moves the message
    # (x-death, x-first-death-*), our reason header is lost and goes to the log instead.
    dead, control = dead_queue(job), control_queue(job)
    operator = open_broker("operator")
    operator.declare([dead, control])
    client = open_broker("client", dead_letter_by_nack=True)
    client.declare([dead, control])
    try:
        operator.publish(
            CONTROL_EXCHANGE, control.routing_key, b"forged", PublishOptions(message_id="f-1")
        )
        client.subscribe(control.name, prefetch=1)
        delivery = client.get(WAIT)
        assert delivery is not None
        caplog.set_level(logging.WARNING, logger="splitmq.broker")

        assert dead_letter_safely(client, delivery, "impostor: c9") is Rejected.DEAD_LETTERED

        operator.subscribe(dead.name, prefetch=1)
        letter = operator.get(WAIT)
        assert letter is not None
        assert (letter.body, letter.message_id) == (b"forged", "f-1")
        assert REASON_HEADER not in letter.headers
        assert letter.headers["x-first-death-queue"] == control.name
        assert letter.headers["x-first-death-reason"] == "rejected"
        operator.ack(letter)
        assert any("impostor: c9" in r.getMessage() for r in caplog.records)
    finally:
        operator.delete_queue(control.name)
        operator.delete_queue(dead.name)


def test_an_inequivalent_queue_says_which_and_how_to_mend_it(
    open_broker: Callable[..., RabbitMQBroker], job: str
) -> None:
    # A `<job>.dead` left by an older SplitMQ (no bounds): today's declare differs from it.
    old = replace(dead_queue(job), max_length=None, max_length_bytes=None)
    broker = open_broker()
    broker.declare([old])
    try:
        with pytest.raises(BrokerError, match="PRECONDITION_FAILED") as excinfo:
            broker.declare([dead_queue(job)])
        text = str(excinfo.value)
        assert f"queue '{job}.dead' exists with other arguments" in text
        assert f"rabbitmqctl delete_queue {job}.dead" in text and "splitmq up --fresh" in text
    finally:
        broker.delete_queue(old.name)


def test_quorum_queue_dead_letters_a_message_that_keeps_coming_back(
    open_broker: Callable[..., RabbitMQBroker], job: str
) -> None:
    # A message whose consumer dies on it each time (a poison batch that crashes the worker
    # before it can dead-letter it) ends in <job>.dead after `delivery_limit` returns, with
    # RabbitMQ's reason, instead of taking down every worker that picks it up.
    quorum = {"queue_type": "quorum", "delivery_limit": 2}
    dead, control = dead_queue(job), control_queue(job)
    operator = open_broker("operator", **quorum)
    operator.declare([dead, control])
    try:
        operator.publish(
            CONTROL_EXCHANGE, control.routing_key, b"crashes", PublishOptions(message_id="p-1")
        )
        for attempt in range(3):  # the first delivery, then two returns: the limit
            doomed = open_broker(f"doomed-{attempt}", **quorum)
            doomed.subscribe(control.name, prefetch=1)
            delivery = doomed.get(WAIT)
            assert delivery is not None and delivery.body == b"crashes"
            doomed.close()  # no ack: the consumer died

        operator.subscribe(dead.name, prefetch=1)
        letter = operator.get(WAIT)
        assert letter is not None
        assert (letter.body, letter.message_id) == (b"crashes", "p-1")
        assert letter.headers["x-first-death-queue"] == control.name
        assert letter.headers["x-first-death-reason"] == "delivery_limit"
        operator.ack(letter)
        assert operator.queue_depth(control.name) == 0
    finally:
        operator.delete_queue(control.name)
        operator.delete_queue(dead.name)


def test_a_handle_given_several_nodes_connects_to_a_live_one(amqp_url: str, job: str) -> None:
    # Whichever node it tries first, a dead one costs one failed attempt, not an outage.
    dead = "amqp://guest:guest@127.0.0.1:1/%2F"
    for seed in range(4):  # the first node tried is picked at random
        options = RabbitMQOptions(give_up_after=10.0, connection_name=f"{job}-{seed}")
        handle = RabbitMQBroker([dead, amqp_url, dead], options, rng=random.Random(seed))
        try:
            assert handle.connects == 1
            spec = control_queue(job)
            handle.declare([spec])
            handle.publish(CONTROL_EXCHANGE, spec.routing_key, b"x")
            assert handle.queue_depth(spec.name) == 1
            handle.delete_queue(spec.name)
        finally:
            handle.close()


def test_doctor_checks_each_node_of_a_cluster(amqp_url: str) -> None:
    from services.common.backends import Backends, Embedded
    from services.config.settings import BrokerSettings, StoreSettings
    from services.runtime.doctor import check_broker

    dead = "amqp://guest:guest@127.0.0.1:1/%2F"
    cluster = BrokerSettings(kind="rabbitmq", amqp_urls=(amqp_url, dead))
    check = check_broker(Backends(cluster, StoreSettings(), Embedded()))

    assert check.ok and check.warning  # usable, but a node is down
    assert check.detail.startswith("1 of 2 nodes up, quorum queues: [ok] RabbitMQ")
    assert "[DOWN] cannot reach RabbitMQ at amqp://guest:***@127.0.0.1:1/" in check.detail
