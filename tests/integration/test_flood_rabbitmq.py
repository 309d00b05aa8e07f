"""One client floods `<job>.updates` with junk; the others' rounds go on at their pace.

Over a real RabbitMQ and Redis: three scripted clients train (each takes `TRAIN_S` per round)
through sync rounds with the real aggregator; from round `CALM` on, a fourth member,
mallory, publishes junk updates (the model's tensors plus one it does not have) as fast as
one connection with confirms allows, from a process of its own, until the job ends. Before
the per-sender budgets each junk update cost the aggregator a confirmed dead-letter publish
(~2 ms), more than mallory needs to publish one, so the junk piled up ahead of the others'
updates and every round waited longer than the last (issue 18: 12,000 junk updates stalled
a round for ~25 s).

The round times before and during the flood are compared in one run (medians, so one slow
round on a loaded machine does not decide), the depth of the updates queue is sampled
throughout, and every junk update is accounted for: judged and dead-lettered with the
screen's reason, refused unjudged (dead-lettered in batches with the reason that mallory was
over budget), or still queued when the job ended. Every dead letter carries a reason header.
"""

from __future__ import annotations

import itertools
import logging
import multiprocessing
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from broker.codec import decode, encode
from broker.errors import BackPressureError
from broker.messages import WeightsAssignment, WeightsUpdate, new_message_id
from broker.rabbitmq import RabbitMQBroker, RabbitMQOptions
from broker.store import SERVER_PART, BlobRef
from broker.topology import (
    CONTROL_EXCHANGE,
    QueueLimits,
    dead_queue_name,
    reply_queue_name,
    updates_queue_name,
    updates_routing_key,
)
from broker.transport import REASON_HEADER, Broker, PublishOptions
from services.aggregator.aggregator import Aggregator, ensure_initial_version
from services.algorithms.registry import build_strategy
from services.common.backends import Backends
from services.common.handout import WeightsCache
from services.config.root import Settings
from services.report.records import ListSink
from tests.unit.test_aggregator_peers import (
    FakeClient,
    FakeWorker,
    add_member,
    declare_all,
    delete_all,
    make_settings,
    running,
    worker_loop,
)

pytestmark = [pytest.mark.rabbitmq, pytest.mark.redis, pytest.mark.slow]

LOG = logging.getLogger("test.flood")

CLIENTS = ("a", "b", "c")
FLOODER = "mallory"
# Each honest client's local round. A round also waits up to 50 ms more for the shard's
# checkpoint (`services.aggregator.rounds` polls the store), so round times come in 50 ms
# steps whatever else happens; at 0.4 s rounds those steps alone moved a median by 12%, and
# which step a stretch of rounds falls on is chance. At 1 s they are within 5%.
TRAIN_S = 1.0
CALM = 7  # rounds before the flood (round 0 waits for everyone to start: not compared)
FLOODED = 7  # rounds during it
WAIT_S = 60.0
SLOWDOWN = 1.2  # the deliverable: the others' rounds at most 20% slower


@pytest.fixture
def settings(job: str, amqp_url: str, redis_url: str) -> Iterator[Settings]:
    settings = make_settings(
        job,
        job={"rounds": 1 + CALM + FLOODED},
        broker={"kind": "rabbitmq", "amqp_url": amqp_url},
        store={"kind": "redis", "redis_url": redis_url},
        clients={"count": len(CLIENTS), "min_to_start": len(CLIENTS)},
        rounds={"deadline_s": 30.0, "quorum": 1.0},
    )
    yield settings
    delete_all(Backends(settings.broker, settings.store), settings, [*CLIENTS, FLOODER])


def publish_patiently(broker: Broker, job: str, body: bytes, stop: threading.Event) -> int:
    """Publish an update, retrying while the queue is full (as `ClientLink` does); refusals."""
    refusals = 0
    while not stop.is_set():
        try:
            broker.publish(CONTROL_EXCHANGE, updates_routing_key(job), body)
            return refusals
        except BackPressureError:
            refusals += 1
            time.sleep(0.01)
    return refusals


def honest_client(backends: Backends, job: str, fake: FakeClient) -> Callable[..., None]:
    """Trains for `TRAIN_S`, then uploads; stops when dismissed."""

    def target(stop: threading.Event) -> None:
        broker = backends.open_broker(f"honest-{fake.client}")
        try:
            broker.subscribe(reply_queue_name(job, fake.client), prefetch=8)
            while not stop.is_set():
                delivery = broker.get(0.05)
                if delivery is None:
                    continue
                message = decode(delivery.body)
                broker.ack(delivery)
                if not isinstance(message, WeightsAssignment):
                    continue
                if not message.participate:
                    return
                if stop.wait(TRAIN_S):
                    return
                publish_patiently(broker, job, encode(fake.update(message)), stop)
        finally:
            broker.close()

    return target


class Flood:
    """mallory's junk, as fast as one confirmed connection goes, from `start` until stopped.

    From a process of its own, as a client is: in this one it would take its CPU from the
    honest clients' threads (one GIL), and the test would measure its harness under load.
    """

    def __init__(self, amqp_url: str, job: str, body: bytes) -> None:
        context = multiprocessing.get_context("spawn")
        self.start = context.Event()
        self._stop = context.Event()
        self._sent = context.Value("q", 0)
        self._refused = context.Value("q", 0)  # publishes the full queue refused
        self._process = context.Process(
            target=flood,
            args=(amqp_url, job, body, self.start, self._stop, self._sent, self._refused),
            daemon=True,
        )
        self._process.start()

    @property
    def sent(self) -> int:
        return int(self._sent.value)

    @property
    def refused(self) -> int:
        return int(self._refused.value)

    def run(self, stop: threading.Event) -> None:
        stop.wait()
        self._stop.set()
        self._process.join(10.0)
        assert self._process.exitcode == 0, f"the flooder ended with {self._process.exitcode}"


def flood(
    amqp_url: str, job: str, body: bytes, start: Any, stop: Any, sent: Any, refused: Any
) -> None:
    """The flooder process: publishes `body` once `start` is set, until `stop` is."""
    broker = RabbitMQBroker(amqp_url, RabbitMQOptions(connection_name=f"{job}-flooder"))
    try:
        while not start.wait(0.05):
            if stop.is_set():
                return
        key = updates_routing_key(job)
        while not stop.is_set():
            try:
                broker.publish(
                    CONTROL_EXCHANGE, key, body, PublishOptions(message_id=new_message_id())
                )
                with sent.get_lock():
                    sent.value += 1
            except BackPressureError:
                with refused.get_lock():
                    refused.value += 1
    finally:
        broker.close()


class Depths:
    """Samples the depth of the updates queue every 50 ms."""

    def __init__(self, backends: Backends, job: str) -> None:
        self.backends, self.job = backends, job
        self.samples: list[int] = []

    def run(self, stop: threading.Event) -> None:
        broker = self.backends.open_broker("depth-sampler")
        try:
            while not stop.wait(0.05):
                self.samples.append(broker.queue_depth(updates_queue_name(self.job)))
        finally:
            broker.close()


def junk(job: str, weights: dict[str, torch.Tensor]) -> bytes:
    """An update the screen refuses whatever the round: a tensor the model does not have."""
    tensors = {**weights, "not_in_the_model": torch.zeros(4)}
    return encode(WeightsUpdate(job, FLOODER, new_message_id(), 1, 0, 10, tensors, {}))


def test_a_flooding_client_is_throttled_and_the_others_rounds_keep_their_pace(
    settings: Settings, amqp_url: str
) -> None:
    job = settings.job.name
    backends = Backends(settings.broker, settings.store)
    store = backends.open_store()
    try:
        ensure_initial_version(store, settings, build_strategy("sfl_v2"), LOG)
        for i, client in enumerate(CLIENTS):
            add_member(store, job, client, samples=10, partition=i)
        # A member with no training samples: never in a cohort, yet not a stranger either.
        add_member(store, job, FLOODER, samples=0, partition=len(CLIENTS))
        declare_all(backends, settings, [*CLIENTS, FLOODER])
        weights, _ = WeightsCache(store, job, 1).global_weights()
        flood = Flood(amqp_url, job, junk(job, weights))
        depths = Depths(backends, job)
        fakes = [FakeClient(c, 10, lambda r: 1.0) for c in CLIENTS]
        worker = FakeWorker(store.read_blob(job, 1, BlobRef(SERVER_PART)), lambda r: -1.0)
        sink = ListSink()
        aggregator = Aggregator(settings, backends, sink=sink, poll_s=0.05)
        done = threading.Event()

        def aggregate(stop: threading.Event) -> None:
            aggregator.run(stop)
            done.set()

        def start_the_flood(stop: threading.Event) -> None:
            while not stop.wait(0.02):
                if len(sink.records) >= 1 + CALM:
                    flood.start.set()
                    return

        peers = [honest_client(backends, job, f) for f in fakes]
        peers += [worker_loop(backends, job, 1, worker), flood.run, depths.run, start_the_flood]
        with running([*peers, aggregate]) as stop:
            finished = done.wait(WAIT_S)
            stop.set()
        assert finished, f"the job did not finish: {len(sink.records)} rounds"

        assert sink.status == "finished"
        assert all(r.participants == len(CLIENTS) for r in sink.records)
        ends = [r.elapsed_s for r in sink.records]
        times = [b - a for a, b in itertools.pairwise(ends)]
        calm, flooded = times[: CALM - 1], times[CALM:]
        slowdown = statistics.median(flooded) / statistics.median(calm)
        print(
            f"round s calm {[round(t, 3) for t in calm]} flooded {[round(t, 3) for t in flooded]}"
            f" slowdown {slowdown:.3f}; junk sent {flood.sent} "
            f"({flood.sent / sum(flooded):.0f}/s), refused {flood.refused}, "
            f"throttled {aggregator.inbox_stats.throttled}, judged "
            f"{aggregator.inbox_stats.dead_lettered}; max depth {max(depths.samples)}"
        )
        assert flood.sent > 0 and aggregator.inbox_stats.throttled > 0
        assert slowdown <= SLOWDOWN, (calm, flooded)
        assert max(depths.samples) <= QueueLimits().updates_max_length
        # Every junk update is accounted for: dead-lettered (judged or not) or still queued.
        broker = backends.open_broker("test-count")
        try:
            # The aggregator's unacked deliveries return to the queue as its connection closes.
            deadline = time.monotonic() + 10.0
            while True:
                dead = broker.queue_depth(dead_queue_name(job))
                queued = broker.queue_depth(updates_queue_name(job))
                if dead + queued == flood.sent or time.monotonic() > deadline:
                    break
                time.sleep(0.05)
            assert dead + queued == flood.sent, (dead, queued, flood.sent)
            reasons = take_reasons(broker, dead_queue_name(job), dead)
        finally:
            broker.close()
        # The judged ones carry the screen's reason, the refused ones that of their budget.
        assert len(reasons) == dead
        assert None not in reasons, f"{reasons.count(None)} of {dead} without a reason"
        assert any("unknown tensors" in r for r in reasons if r), reasons[:3]
        assert any(r.startswith("over_budget: sender 'mallory'") for r in reasons if r)
    finally:
        store.close()


def take_reasons(broker: Broker, queue: str, count: int) -> list[str | None]:
    """The reason headers of the `count` dead letters in `queue` (taken off it)."""
    broker.subscribe(queue, prefetch=500)
    out: list[str | None] = []
    while len(out) < count:
        delivery = broker.get(WAIT_S)
        assert delivery is not None, f"{len(out)} of {count} dead letters"
        value = delivery.headers.get(REASON_HEADER)
        out.append(value if isinstance(value, str) else None)
        broker.ack(delivery)
    return out
