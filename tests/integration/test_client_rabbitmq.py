"""The edge client over a real RabbitMQ: Join → Welcome → rounds → updates → finished."""

from __future__ import annotations

import threading

import pytest

from broker.store import WeightStore
from services.client.client import Client
from services.client.data import JobData
from services.common.backends import Backends
from services.data.loaders import load_dataset
from tests.unit.test_client_peers import (
    PeerScript,
    ScriptedPeers,
    make_settings,
    max_diff,
    peer_queue_names,
    reference_split,
)

pytestmark = pytest.mark.rabbitmq

CLIENT = "edge-1"


class BrokerOnly(Backends):
    """Design §3: a client never touches the store."""

    def open_store(self) -> WeightStore:
        raise AssertionError("the client opened the weight store")


def test_join_rounds_and_updates_over_rabbitmq(job: str, amqp_url: str) -> None:
    settings = make_settings(job, broker={"kind": "rabbitmq", "amqp_url": amqp_url})
    backends = BrokerOnly(settings.broker, settings.store)
    dataset = load_dataset("fashion_mnist_sample", env={})
    halt = threading.Event()
    peers = ScriptedPeers(settings, backends, PeerScript(rounds=2), halt)
    peers.start()
    try:
        assert peers.ready.wait(30)
        client = Client(
            settings, backends, client_id=CLIENT, partition=4, dataset=JobData(settings, dataset)
        )
        stats = client.run(threading.Event())
    finally:
        halt.set()
        log = peers.finish(30)
        cleanup = backends.open_broker("test-cleanup")
        for queue in peer_queue_names(job, CLIENT):
            cleanup.delete_queue(queue)
        cleanup.close()

    expected = reference_split(settings, dataset, 4, rounds=2)
    assert [u.round for u in log.updates] == [0, 1]
    for update, reference in zip(log.updates, expected, strict=True):
        assert update.client == CLIENT and update.job == job
        assert max_diff(dict(update.client_weights), reference) <= 1e-5
    steps = settings.algorithm.max_steps_per_round
    assert stats.rounds == 2 and stats.finished
    assert stats.batches_sent == stats.replies_received == 2 * steps
    assert stats.dead_lettered == 0 and stats.backpressure_retries == 0
    assert log.joins[0].info["index"] == "4"
    assert log.heartbeats >= 1
    assert [leave.reason for leave in log.leaves] == ["finished"]
