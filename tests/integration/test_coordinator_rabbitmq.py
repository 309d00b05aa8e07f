"""The coordinator on a real RabbitMQ and Redis: Join → Welcome, re-join, leave."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest
import torch

from broker.codec import decode, encode
from broker.messages import Join, Leave, Message, Welcome, new_message_id
from broker.store import CLIENT_PART, BlobRef
from broker.topology import CONTROL_EXCHANGE, reply_queue_name
from broker.transport import Broker
from services.aggregator.aggregator import ensure_initial_version
from services.algorithms.registry import build_strategy
from services.common.backends import Backends
from services.common.membership import client_members
from services.config.root import Settings
from services.coordinator.coordinator import Coordinator
from tests.unit.test_aggregator_peers import (
    WAIT_S,
    declare_all,
    delete_all,
    make_settings,
    running,
)

pytestmark = [pytest.mark.rabbitmq, pytest.mark.redis]


@pytest.fixture
def settings(job: str, amqp_url: str, redis_url: str) -> Iterator[Settings]:
    settings = make_settings(
        job,
        broker={"kind": "rabbitmq", "amqp_url": amqp_url},
        store={"kind": "redis", "redis_url": redis_url},
        clients={"count": 2, "min_to_start": 1},
        algorithm={"name": "sfl_v1"},
    )
    yield settings
    delete_all(Backends(settings.broker, settings.store), settings, ["a"])


def next_reply(broker: Broker) -> Message:
    delivery = broker.get(WAIT_S)
    assert delivery is not None, "no reply"
    broker.ack(delivery)
    return decode(delivery.body)


def test_join_welcome_rejoin_and_leave(settings: Settings) -> None:
    job = settings.job.name
    backends = Backends(settings.broker, settings.store)
    store = backends.open_store()
    client = backends.open_broker("test-client-a")
    try:
        strategy = build_strategy(settings.algorithm.name, settings.algorithm.params())
        ensure_initial_version(store, settings, strategy, logging.getLogger("test"))
        declare_all(backends, settings, ["a"])  # the coordinator may not have declared yet
        client.subscribe(reply_queue_name(job, "a"), prefetch=4)
        coordinator = Coordinator(settings, backends, poll_s=0.05)
        with running([coordinator.run]):
            join = Join(job, "a", new_message_id(), 0, 77, 0, {"index": "1", "classes": "3"})
            client.publish(CONTROL_EXCHANGE, job, encode(join))
            welcome = next_reply(client)
            client.publish(CONTROL_EXCHANGE, job, encode(join))
            again = next_reply(client)
            member = client_members(store, job)["a"]
            client.publish(CONTROL_EXCHANGE, job, encode(Leave(job, "a", new_message_id(), 1)))
            # Leave has no reply; a Join behind it in the queue shows it was handled.
            client.publish(CONTROL_EXCHANGE, job, encode(join))
            last = next_reply(client)
        assert isinstance(welcome, Welcome) and isinstance(again, Welcome)
        assert isinstance(last, Welcome)
        assert (welcome.version, welcome.shard, welcome.config["partition"]) == (1, 1, 1)
        assert (again.shard, again.config["partition"]) == (1, 1)
        expected = store.read_blob(job, 1, BlobRef(CLIENT_PART))
        assert all(torch.equal(welcome.client_weights[n], t) for n, t in expected.items())
        assert (member.samples, member.classes, member.partition) == (77, (3,), 1)
        stats = coordinator.stats
        assert (stats.joined, stats.rejoined, stats.left) == (2, 1, 1)
    finally:
        client.close()
        store.close()
