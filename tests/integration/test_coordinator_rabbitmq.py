"""The coordinator on a real RabbitMQ and Redis: Join → Welcome, re-join, leave; replayed
Joins and each session's seq base (issue 33: one Join replayed many times put as many full
Welcomes on the client's reply queue; a session's seqs start at its Welcome's `seq_base`)."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from dataclasses import replace

import pytest
import torch

from broker.codec import decode, encode
from broker.messages import Join, Leave, Message, SmashedBatch, Welcome, new_message_id
from broker.store import CLIENT_PART, BlobRef
from broker.topology import CONTROL_EXCHANGE, dead_queue_name, reply_queue_name, shard_queue_name
from broker.transport import Broker
from services.aggregator.aggregator import ensure_initial_version
from services.algorithms.registry import build_strategy
from services.client.client import Client
from services.client.data import JobData
from services.common.backends import Backends
from services.common.membership import client_members
from services.config.root import Settings
from services.coordinator.coordinator import Coordinator
from services.coordinator.welcomes import REWELCOME_S
from services.data.loaders import load_dataset
from tests.integration.test_flood_rabbitmq import take_reasons
from tests.unit.test_aggregator_peers import (
    WAIT_S,
    declare_all,
    delete_all,
    make_settings,
    running,
)

pytestmark = [pytest.mark.rabbitmq, pytest.mark.redis]

CLIENTS = ["a", "b"]
REPLAYS = 100


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
    delete_all(Backends(settings.broker, settings.store), settings, CLIENTS)


def start(settings: Settings) -> None:
    """Version 1 published and every queue declared, as before the coordinator starts."""
    backends = Backends(settings.broker, settings.store)
    store = backends.open_store()
    try:
        strategy = build_strategy(settings.algorithm.name, settings.algorithm.params())
        ensure_initial_version(store, settings, strategy, logging.getLogger("test"))
    finally:
        store.close()
    declare_all(backends, settings, CLIENTS)


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
        start(settings)  # the coordinator may not have declared yet
        client.subscribe(reply_queue_name(job, "a"), prefetch=4)
        coordinator = Coordinator(settings, backends, poll_s=0.05)
        with running([coordinator.run]):
            join = Join(job, "a", new_message_id(), 0, 77, 0, {"index": "1", "classes": "3"})
            client.publish(CONTROL_EXCHANGE, job, encode(join))
            welcome = next_reply(client)
            time.sleep(REWELCOME_S)  # a client is welcomed again only after the interval
            client.publish(CONTROL_EXCHANGE, job, encode(replace(join, message_id="rejoin")))
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


def replies(broker: Broker, client: str, job: str, *, wait_s: float) -> list[Message]:
    """Everything on `client`'s reply queue (the first within `wait_s`, the rest at once)."""
    broker.subscribe(reply_queue_name(job, client), prefetch=200)
    out: list[Message] = []
    while (delivery := broker.get(wait_s if not out else 0.5)) is not None:
        out.append(decode(delivery.body))
        broker.ack(delivery)
    return out


def session_join(job: str, client: str, session: str) -> Join:
    return Join(job, client, new_message_id(), 0, 60, 0, {"index": "0", "session": session})


def test_a_replayed_join_is_welcomed_once_and_the_replays_dead_lettered(
    settings: Settings,
) -> None:
    job = settings.job.name
    start(settings)
    backends = Backends(settings.broker, settings.store)
    client = backends.open_broker("test-client")
    try:
        coordinator = Coordinator(settings, backends, poll_s=0.05)
        with running([coordinator.run]):
            body = encode(session_join(job, "a", "s1"))
            for _ in range(1 + REPLAYS):
                client.publish(CONTROL_EXCHANGE, job, body)
            # One queue, one consumer, in order: b's Welcome comes after all of a's Joins.
            client.publish(CONTROL_EXCHANGE, job, encode(session_join(job, "b", "t1")))
            assert [type(m) for m in replies(client, "b", job, wait_s=WAIT_S)] == [Welcome]
            to_a = replies(client, "a", job, wait_s=1.0)
            dead = client.queue_depth(dead_queue_name(job))
            reasons = take_reasons(client, dead_queue_name(job), dead)
    finally:
        client.close()
    assert [type(m) for m in to_a] == [Welcome], f"{len(to_a)} replies to one session's Join"
    assert len(reasons) == REPLAYS
    assert all(r is not None and r.startswith("replayed_join: ") for r in reasons), reasons[:3]
    assert coordinator.stats.replays == REPLAYS


def test_a_session_keeps_its_seq_base_and_a_new_one_starts_above_it(settings: Settings) -> None:
    job = settings.job.name
    start(settings)
    backends = Backends(settings.broker, settings.store)
    client = backends.open_broker("test-client")
    store = backends.open_store()
    try:
        coordinator = Coordinator(settings, backends, poll_s=0.05)
        with running([coordinator.run]):
            client.publish(CONTROL_EXCHANGE, job, encode(session_join(job, "a", "s1")))
            (first,) = replies(client, "a", job, wait_s=WAIT_S)
            recorded = client_members(store, job)["a"]
            # The same session asks again past the interval (its Welcome was lost, say).
            time.sleep(REWELCOME_S)
            client.publish(CONTROL_EXCHANGE, job, encode(session_join(job, "a", "s1")))
            (again,) = replies(client, "a", job, wait_s=WAIT_S)
            # A new process of the client, within the interval of the last Welcome: it is
            # welcomed once the interval is over, without asking again, and nothing is
            # dead-lettered.
            client.publish(CONTROL_EXCHANGE, job, encode(session_join(job, "a", "s2")))
            (restarted,) = replies(client, "a", job, wait_s=WAIT_S)
            record = client_members(store, job)["a"]
            dead = client.queue_depth(dead_queue_name(job))
    finally:
        client.close()
        store.close()
    assert isinstance(first, Welcome) and isinstance(again, Welcome)
    assert isinstance(restarted, Welcome)
    assert first.seq_base > 0 and recorded.seq_base == first.seq_base
    assert again.seq_base == first.seq_base
    assert restarted.seq_base > first.seq_base and record.seq_base == restarted.seq_base
    assert record.session == "s2"
    assert dead == 0


def test_a_clients_first_batch_is_its_welcomes_seq_base(settings: Settings) -> None:
    """The real client and coordinator, in an async job (the Welcome is the first round's
    work): the first SmashedBatch on the shard queue (no worker takes it) carries the seq_base
    that the Welcome brought and the record keeps."""
    settings = settings.model_copy(
        update={"rounds": settings.rounds.model_copy(update={"mode": "async"})}
    )
    job = settings.job.name
    start(settings)
    backends = Backends(settings.broker, settings.store)
    tap = backends.open_broker("test-tap")
    store = backends.open_store()
    dataset = JobData(settings, load_dataset("fashion_mnist_sample", env={}))
    client = Client(settings, backends, client_id="a", partition=0, dataset=dataset)
    try:
        coordinator = Coordinator(settings, backends, poll_s=0.05)
        with running([coordinator.run, client.run]) as stop:
            tap.subscribe(shard_queue_name(job, 0), prefetch=1)
            delivery = tap.get(WAIT_S)
            assert delivery is not None, "no batch from the client"
            batch = decode(delivery.body, expect=SmashedBatch)
            record = client_members(store, job)["a"]
            stop.set()
    finally:
        tap.close()
        store.close()
    assert record.seq_base > 0
    assert batch.seq == record.seq_base
