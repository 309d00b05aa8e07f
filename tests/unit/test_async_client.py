"""The edge client in async mode against a scripted service on the in-memory hub: it trains
from its Welcome at once, uploads, trains on from whatever weights each upload is answered
with, drops a local round a worker calls too stale and asks for newer weights by joining
again, and leaves when the job is over."""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt
import pytest

from broker.codec import decode, encode
from broker.memory_broker import InMemoryBroker
from broker.messages import (
    GradientReply,
    Join,
    Leave,
    Message,
    SmashedBatch,
    WeightsAssignment,
    WeightsUpdate,
    Welcome,
    new_message_id,
)
from broker.store import CLIENT_PART, BlobRef
from broker.topology import (
    REPLIES_EXCHANGE,
    QueueLimits,
    control_queue,
    dead_queue,
    reply_routing_key,
    shard_queue,
    updates_queue,
)
from broker.transport import Broker
from services.algorithms.registry import build_strategy
from services.algorithms.staleness import TOO_STALE
from services.client.client import Client
from services.client.data import JobData
from services.common.backends import Backends, Embedded
from services.config.root import Settings
from services.data.loaders import Dataset, load_dataset
from tests.unit.test_client_peers import make_settings, seeded_model

CLIENT = "c1"
UPLOADS = 3


@pytest.fixture(scope="module")
def dataset() -> Dataset:
    return load_dataset("fashion_mnist_sample", env={})


@dataclass
class Service:
    """Coordinator, aggregator and worker of an async job, scripted on one thread."""

    settings: Settings
    version: int = 1
    joins: list[Join] = field(default_factory=list)
    updates: list[WeightsUpdate] = field(default_factory=list)
    batches: list[SmashedBatch] = field(default_factory=list)
    left: threading.Event = field(default_factory=threading.Event)

    def serve(self, broker: Broker, halt: threading.Event, ready: threading.Event) -> None:
        job = self.settings.job.name
        queues = [control_queue(job), updates_queue(job), shard_queue(job, 0, QueueLimits())]
        broker.declare([dead_queue(job), *queues])
        for spec in queues:
            broker.subscribe(spec.name, prefetch=8)
        model = seeded_model(self.settings)
        strategy = build_strategy("sfl_v2")
        self.weights = dict(strategy.initial_weights(model, "block1")[BlobRef(CLIENT_PART)])
        ready.set()
        while not halt.is_set() and not self.left.is_set():
            delivery = broker.get(0.02)
            if delivery is None:
                continue
            self.handle(broker, decode(delivery.body))
            broker.ack(delivery)

    def reply(self, broker: Broker, message: Message) -> None:
        key = reply_routing_key(self.settings.job.name, CLIENT)
        broker.publish(REPLIES_EXCHANGE, key, encode(message))

    def handle(self, broker: Broker, message: Message) -> None:
        job = self.settings.job.name
        if isinstance(message, Join):
            self.joins.append(message)
            config = {"algorithm": "sfl_v2", "mode": "async", "partition": 3}
            welcome = Welcome(
                job, CLIENT, new_message_id(), self.version, 0, "block1", 0, self.weights, {},
                config,
            )  # fmt: skip
            self.reply(broker, welcome)
        elif isinstance(message, Leave):
            self.left.set()
        elif isinstance(message, WeightsUpdate):
            self.updates.append(message)
            self.version += 1
            finished = len(self.updates) >= UPLOADS
            answer = WeightsAssignment(
                job, CLIENT, new_message_id(), self.version, message.round + 1, not finished,
                {} if finished else self.weights, {},
                {"finished": True} if finished else {"mode": "async"},
            )  # fmt: skip
            self.reply(broker, answer)
        elif isinstance(message, SmashedBatch):
            self.batches.append(message)
            first_of_round_1 = message.round == 1 and message.step == 0
            status, reason = (
                ("rejected", f"{TOO_STALE}: scripted") if first_of_round_1 else ("ok", "")
            )
            grad = (
                None if status != "ok" else message.activations.new_zeros(message.activations.shape)
            )
            reply = GradientReply(
                job, CLIENT, new_message_id(), self.version, message.seq, status, 1.0, 0,
                int(message.labels.shape[0]), grad, reason,
            )  # fmt: skip
            self.reply(broker, reply)


def test_an_async_client_trains_back_to_back_and_refreshes_stale_weights(
    job: str, dataset: Dataset
) -> None:
    settings = make_settings(job, rounds={"mode": "async"}, clients={"count": 4})
    embedded = Embedded()
    backends = Backends(settings.broker, settings.store, embedded)
    service = Service(settings)
    halt, ready = threading.Event(), threading.Event()
    peer = threading.Thread(
        target=service.serve, args=(InMemoryBroker(embedded.hub), halt, ready), daemon=True
    )
    peer.start()
    assert ready.wait(10)
    client = Client(
        settings, backends, client_id=CLIENT, partition=3, dataset=JobData(settings, dataset)
    )
    try:
        stats = client.run(threading.Event())
    finally:
        halt.set()
        peer.join(10)

    assert stats.finished and stats.rounds == UPLOADS and stats.stale_rounds == 1
    # Round 0 from the Welcome (v1), answered with v2; round 1 refused as too stale, so the
    # client joined again and trained round 2 from that Welcome (v2); round 3 from v3.
    assert [(u.round, u.version) for u in service.updates] == [(0, 1), (2, 2), (3, 3)]
    assert len(service.joins) == 2 and stats.joins_sent == 2
    steps = settings.algorithm.max_steps_per_round
    assert len(service.batches) == 3 * steps + 1  # the refused batch ended its round
    assert service.left.is_set()


class EmptyPartition(JobData):
    """Partition 3 holds no training samples (a Dirichlet split can leave one empty)."""

    def indices(self, index: int) -> npt.NDArray[np.int64]:
        return np.empty(0, dtype=np.int64) if index == 3 else super().indices(index)


@dataclass
class DismissingService(Service):
    """Welcomes the client, then ends the job: the dismissal every live member gets."""

    def handle(self, broker: Broker, message: Message) -> None:
        super().handle(broker, message)
        if isinstance(message, Join):
            job = self.settings.job.name
            dismissal = WeightsAssignment(
                job, CLIENT, new_message_id(), self.version, 0, False, {}, {}, {"finished": True}
            )
            self.reply(broker, dismissal)


def test_an_async_client_without_samples_uploads_nothing_and_waits_for_the_end(
    job: str, dataset: Dataset, caplog: pytest.LogCaptureFixture
) -> None:
    """Its updates would report 0 samples (refused as `no_samples`): it trains nothing, says
    why once, stays a member, and leaves when the job's end dismisses it."""
    settings = make_settings(job, rounds={"mode": "async"}, clients={"count": 4})
    embedded = Embedded()
    backends = Backends(settings.broker, settings.store, embedded)
    service = DismissingService(settings)
    halt, ready = threading.Event(), threading.Event()
    peer = threading.Thread(
        target=service.serve, args=(InMemoryBroker(embedded.hub), halt, ready), daemon=True
    )
    peer.start()
    assert ready.wait(10)
    data = EmptyPartition(settings, dataset)
    client = Client(settings, backends, client_id=CLIENT, partition=3, dataset=data)
    try:
        with caplog.at_level(logging.INFO, "splitmq.client"):
            stats = client.run(threading.Event())
        # The client's Leave is published as it returns; the service thread takes it from the
        # queue a moment later, so halting it at once could drop the Leave unread.
        service.left.wait(10)
    finally:
        halt.set()
        peer.join(10)

    assert stats.finished and stats.rounds == 0 and stats.rounds_aborted == 0
    assert service.batches == [] and service.updates == []  # nothing trained, nothing uploaded
    assert [j.samples for j in service.joins] == [0] and service.left.is_set()
    said = [r.getMessage() for r in caplog.records if "no training samples" in r.getMessage()]
    assert len(said) == 1 and f"client {CLIENT}: partition 3 " in said[0]
