"""Membership heartbeats come from a thread of their own (services/client/beat.py): a training
step that outlasts the heartbeat TTL does not expire a live client."""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest

from broker.codec import decode
from broker.errors import BrokerUnavailableError
from broker.memory_broker import InMemoryBroker
from broker.memory_store import InMemoryWeightStore
from broker.messages import Heartbeat, Message
from broker.topology import control_queue, control_queue_name
from services.aggregator.aggregator import ensure_initial_version
from services.algorithms.base import LocalRound, RoundResult
from services.algorithms.fedavg import FedAvg
from services.algorithms.registry import build_strategy
from services.client.beat import HeartbeatThread
from services.client.client import Client
from services.client.stats import ClientStats
from services.common.backends import Backends, Embedded
from services.common.handout import WeightsCache, assignment, dismissal
from services.common.membership import client_members
from services.common.outbox import Outbox
from services.coordinator.coordinator import Coordinator
from services.data.loaders import load_dataset
from tests.unit.test_aggregator_peers import WAIT_S, ManualClock, running
from tests.unit.test_client_peers import make_settings

LOG = logging.getLogger("test.heartbeat")
TTL_S = 1.0


def wait_until(predicate: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


@dataclass(frozen=True)
class HeldFedAvg(FedAvg):
    """FedAvg whose local round first holds until the test releases it: one very long step."""

    holding: threading.Event = field(default_factory=threading.Event)
    release: threading.Event = field(default_factory=threading.Event)

    def client_round(self, r: LocalRound) -> RoundResult:
        self.holding.set()
        assert self.release.wait(WAIT_S), "the held step was never released"
        return super().client_round(r)


def test_a_step_longer_than_the_ttl_does_not_expire_the_member(
    job: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = make_settings(
        job,
        algorithm={"name": "fedavg"},
        clients={"count": 2, "heartbeat_s": 0.02, "heartbeat_ttl_s": TTL_S},
    )
    # The store's clock moves only when the test says: expiry is decided by it alone.
    store_clock = ManualClock()
    embedded = Embedded(store=InMemoryWeightStore(clock=store_clock))
    store = embedded.store
    backends = Backends(settings.broker, settings.store, embedded)
    ensure_initial_version(store, settings, build_strategy("fedavg"), LOG)
    holding, release = threading.Event(), threading.Event()
    monkeypatch.setattr(
        "services.client.membership.build_strategy",
        lambda *_: HeldFedAvg(holding=holding, release=release),
    )
    coordinator = Coordinator(settings, backends, poll_s=0.02)
    dataset = load_dataset("fashion_mnist_sample", env={})
    client = Client(settings, backends, client_id="c1", partition=0, dataset=dataset)
    results: list[ClientStats] = []
    aggregator = backends.open_broker("test-aggregator")
    outbox = Outbox(aggregator, job, LOG)

    def beats() -> int:
        return coordinator.stats.heartbeats

    with running([coordinator.run, lambda stop: results.append(client.run(stop))]):
        wait_until(lambda: "c1" in client_members(store, job), "the client's Join")
        cohort = client_members(store, job)
        weights = WeightsCache(store, job, 1)
        for client, info in cohort.items():
            outbox.reply(client, assignment(settings, weights, client, info.partition, 0))
        assert holding.wait(WAIT_S), "the client did not start its round"
        # The step holds; three TTLs pass on the store's clock, 0.6 TTL after each fresh beat.
        for _ in range(5):
            seen = beats()
            wait_until(more_than(beats, seen), "a heartbeat during the held step")
            store_clock.advance(0.6 * TTL_S)
            assert "c1" in client_members(store, job)
        release.set()
        outbox.reply("c1", dismissal(settings, "c1", 2, "finished"))
        wait_until(lambda: bool(results), "the client's end")
    aggregator.close()

    stats = results[0]
    assert stats.finished and stats.rounds == 1 and stats.rounds_aborted == 0
    assert stats.heartbeats_sent >= 5
    assert (coordinator.stats.expired, coordinator.stats.unknown_heartbeats) == (0, 0)


def more_than(count: Callable[[], int], seen: int) -> Callable[[], bool]:
    return lambda: count() > seen


class FlakyBroker(InMemoryBroker):
    """Refuses its first `failures` publishes as if the broker were unreachable."""

    failures = 0

    def publish(self, exchange: str, routing_key: str, body: bytes, *rest: Any) -> None:
        if FlakyBroker.failures > 0:
            FlakyBroker.failures -= 1
            raise BrokerUnavailableError("broker down (test)")
        super().publish(exchange, routing_key, body, *rest)


def test_the_heartbeat_thread_outlives_a_broker_outage_and_stops_for_leave(job: str) -> None:
    embedded = Embedded()
    reader = InMemoryBroker(embedded.hub)
    reader.declare([control_queue(job)])
    reader.subscribe(control_queue_name(job), prefetch=100)
    opened: list[FlakyBroker] = []

    def open_broker() -> FlakyBroker:
        opened.append(FlakyBroker(embedded.hub))
        return opened[-1]

    FlakyBroker.failures = 2
    versions = itertools.count()
    beat = HeartbeatThread(
        open_broker,
        job=job,
        client="c1",
        interval_s=0.01,
        version=lambda: next(versions),
        logger=LOG,
    )
    beat.start()
    got: list[Message] = []
    wait_until(lambda: collect(reader, got) >= 3, "three heartbeats after the outage")
    assert beat.stop()
    collect(reader, got)
    assert all(isinstance(m, Heartbeat) and m.client == "c1" for m in got)
    assert beat.sent == len(got)
    # Each failed publish dropped its handle; the next beat opened a fresh one.
    assert len(opened) == 3
    reader.close()


def collect(reader: InMemoryBroker, into: list[Message]) -> int:
    while (delivery := reader.get(0.0)) is not None:
        into.append(decode(delivery.body))
        reader.ack(delivery)
    return len(into)
