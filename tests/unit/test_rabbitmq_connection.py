"""RabbitMQ connection settings, backoff and giving up, without a server."""

from __future__ import annotations

import random
import socket

import pytest

from broker.errors import BrokerUnavailableError
from broker.rabbitmq import RabbitMQBroker
from broker.rabbitmq_connection import Outage, RabbitMQOptions, connection_parameters
from broker.rabbitmq_declare import queue_arguments
from broker.topology import (
    DEAD_EXCHANGE,
    dead_queue,
    events_queue,
    infer_reply_queue,
    reply_queue,
    shard_queue,
)
from broker.transport import Backoff


class FakeTime:
    """A clock that only moves when the code under test sleeps."""

    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps: list[float] = []

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


def closed_port() -> int:
    """A local port nobody listens on (bound, then released)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
    return port


def test_backoff_doubles_up_to_the_cap_with_bounded_jitter() -> None:
    backoff = Backoff(initial=0.1, cap=2.0)
    rng = random.Random(7)

    for attempt, base in [(0, 0.1), (1, 0.2), (3, 0.8), (5, 2.0), (10_000, 2.0)]:
        delays = [backoff.delay(attempt, rng) for _ in range(200)]
        assert all(base / 2 <= d <= base for d in delays)
        assert max(delays) - min(delays) > base / 4  # jittered, not constant


def test_outage_gives_up_after_the_total_time() -> None:
    fake = FakeTime()
    options = RabbitMQOptions(
        reconnect_initial_delay=1.0, reconnect_max_delay=4.0, give_up_after=10
    )
    outage = Outage(options, clock=fake.clock, sleep=fake.sleep, rng=random.Random(1))
    cause = ConnectionError("refused")

    with pytest.raises(BrokerUnavailableError, match="publish: RabbitMQ unreachable") as excinfo:
        for _ in range(100):
            outage.wait_or_give_up(cause, "publish")

    assert sum(fake.sleeps) <= 10
    assert len(fake.sleeps) >= 3
    assert excinfo.value.__cause__ is cause


def test_outage_respects_the_attempt_limit() -> None:
    fake = FakeTime()
    options = RabbitMQOptions(connection_attempts=3, give_up_after=1e9)
    outage = Outage(options, clock=fake.clock, sleep=fake.sleep, rng=random.Random(1))

    with pytest.raises(BrokerUnavailableError, match="3 attempt"):
        for _ in range(10):
            outage.wait_or_give_up(ConnectionError("refused"), "connect")

    assert len(fake.sleeps) == 2  # no sleep after the last attempt


def test_unreachable_server_raises_unavailable_after_retrying() -> None:
    fake = FakeTime()
    options = RabbitMQOptions(reconnect_initial_delay=0.5, give_up_after=3.0)

    with pytest.raises(BrokerUnavailableError, match="connect: RabbitMQ unreachable"):
        RabbitMQBroker(
            f"amqp://guest:guest@127.0.0.1:{closed_port()}/%2F",
            options,
            clock=fake.clock,
            sleep=fake.sleep,
        )

    assert len(fake.sleeps) >= 2


def test_connection_parameters_apply_options_and_name() -> None:
    options = RabbitMQOptions(heartbeat=15, blocked_connection_timeout=42.0)

    params = connection_parameters("amqps://u:p@rabbit.example:5671/jobs", options, "worker-1")

    assert (params.host, params.port, params.virtual_host) == ("rabbit.example", 5671, "jobs")
    assert params.credentials.username == "u"
    assert params.ssl_options is not None
    assert (params.heartbeat, params.blocked_connection_timeout) == (15, 42.0)
    assert params.connection_attempts == 1
    assert params.client_properties == {"connection_name": "worker-1"}


def test_only_amqp_urls_are_accepted() -> None:
    with pytest.raises(ValueError, match="amqp:// or amqps://"):
        connection_parameters("http://rabbit.example/", RabbitMQOptions(), "x")


def test_queue_arguments_follow_the_spec() -> None:
    args = queue_arguments(shard_queue("job", 3))

    assert args == {
        "x-single-active-consumer": True,
        "x-max-length": 10_000,
        "x-max-length-bytes": 1 << 30,
        "x-overflow": "reject-publish",
        "x-dead-letter-exchange": DEAD_EXCHANGE,
        "x-dead-letter-routing-key": "job",
    }


def test_quorum_queues_replicate_every_durable_shared_queue() -> None:
    shard = queue_arguments(shard_queue("job", 3), "quorum", delivery_limit=7)
    assert shard == {
        "x-queue-type": "quorum",
        "x-single-active-consumer": True,
        "x-max-length": 10_000,
        "x-max-length-bytes": 1 << 30,
        "x-overflow": "reject-publish",
        "x-dead-letter-exchange": DEAD_EXCHANGE,
        "x-dead-letter-routing-key": "job",
        "x-delivery-limit": 7,
        "x-dead-letter-strategy": "at-least-once",
    }
    # A reply queue has no bound: reject-publish is still set, as at-least-once needs it.
    reply = queue_arguments(reply_queue("job", "c1"), "quorum")
    assert reply["x-overflow"] == "reject-publish"
    assert reply["x-dead-letter-strategy"] == "at-least-once"
    # The dead-letter queue drops its oldest and dead-letters nowhere: no limit, no strategy.
    assert queue_arguments(dead_queue("job"), "quorum") == {
        "x-queue-type": "quorum",
        "x-max-length": 100_000,
        "x-max-length-bytes": 2 << 30,
        "x-overflow": "drop-head",
    }
    # Private queues go with their connection: classic, whatever the setting.
    assert "x-queue-type" not in queue_arguments(events_queue("job", "w"), "quorum")
    assert "x-queue-type" not in queue_arguments(infer_reply_queue("job", "r"), "quorum")
