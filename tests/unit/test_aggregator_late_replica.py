"""A shard's replica handed in after `rounds.replica_timeout_s` (issue 33): every batch the
worker applied in the round must reach a published version. Before, the aggregator went on
without the replica and published the previous version's server weights, so the round's server
training was lost (the worker reloads the replica from each new version).

The aggregator's clock only moves when the test says: the worker holds its replica back until
the aggregator has said, after `replica_timeout_s` on its clock, what it does about it, then
hands it in. Two cases: the shard's worker is alive all along (its heartbeat lists the shard),
and the worker died without handing in (nothing lists the shard) and a successor hands in
later. Over the in-memory hub and store, and over RabbitMQ and Redis.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest
import torch

from broker.codec import decode
from broker.messages import RoundEnd, RoundStart
from broker.store import SERVER_PART, BlobRef, Checkpoint, WeightStore
from broker.topology import shard_queue_name
from broker.transport import Broker
from services.aggregator.aggregator import Aggregator, ensure_initial_version
from services.algorithms.registry import build_strategy
from services.common.backends import Backends, Embedded
from services.common.leases import member_id
from services.config.root import Settings
from services.report.records import ListSink, VersionRecord
from tests.unit.test_aggregator_peers import (
    WAIT_S,
    FakeClient,
    ManualClock,
    add_member,
    client_loop,
    declare_all,
    delete_all,
    filled,
    make_settings,
    running,
)

LOG = logging.getLogger("test.aggregator.late_replica")
SAMPLES = {"a": 100, "b": 300}
REPLICA_TIMEOUT_S = 5.0
SERVER = BlobRef(SERVER_PART)


@pytest.fixture(
    params=[
        "memory",
        pytest.param("rabbitmq+redis", marks=[pytest.mark.rabbitmq, pytest.mark.redis]),
    ]
)
def backends(request: pytest.FixtureRequest, job: str) -> Iterator[tuple[Settings, Backends]]:
    sections: dict[str, dict[str, object]] = {}
    if request.param != "memory":
        sections = {
            "broker": {"kind": "rabbitmq", "amqp_url": request.getfixturevalue("amqp_url")},
            "store": {"kind": "redis", "redis_url": request.getfixturevalue("redis_url")},
        }
    settings = make_settings(
        job,
        job={"rounds": 2},
        clients={"count": 2, "min_to_start": 2},
        rounds={"deadline_s": 60.0, "quorum": 1.0, "replica_timeout_s": REPLICA_TIMEOUT_S},
        **sections,
    )
    embedded = Embedded() if request.param == "memory" else None
    backends = Backends(settings.broker, settings.store, embedded)
    yield settings, backends
    if request.param != "memory":
        delete_all(backends, settings, list(SAMPLES))


class Said(logging.Handler):
    """Set once the aggregator has logged a WARNING about a replica."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.event = threading.Event()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        line = record.getMessage()
        if "replica" in line:
            self.lines.append(line)
            self.event.set()


@dataclass
class LateWorker:
    """Hands in round `late`'s replica (every tensor `value(round)`, the round's samples) only
    after the test's `clock` passed the replica timeout and the aggregator said so; the
    other rounds' at once. `alive`: its heartbeat lists the shard meanwhile (else it died
    before handing in, and a successor does it)."""

    server: dict[str, torch.Tensor]
    late: int
    alive: bool
    clock: ManualClock
    said: Said
    ends: list[RoundEnd] = field(default_factory=list)

    @staticmethod
    def value(round_index: int) -> float:
        return 50.0 + round_index

    def run(self, broker: Broker, store: WeightStore, job: str, stop: threading.Event) -> None:
        broker.subscribe(shard_queue_name(job, 0), prefetch=8)
        samples = 0
        while not stop.is_set():
            if self.alive:
                store.heartbeat(job, member_id("w1"), 60.0, {"shards": "0"})
            delivery = broker.get(0.05)
            if delivery is None:
                continue
            message = decode(delivery.body)
            if isinstance(message, RoundStart):
                samples = sum(int(n) for n in message.participants.values())
            elif isinstance(message, RoundEnd):
                self.ends.append(message)
                if message.round == self.late:
                    self.clock.advance(REPLICA_TIMEOUT_S + 1.0)
                    while not self.said.event.wait(0.05):
                        if self.alive:
                            store.heartbeat(job, member_id("w1"), 60.0, {"shards": "0"})
                        if stop.is_set():
                            return
                meta = {"version": message.version, "round": message.round}
                meta |= {"round_samples": samples, "seqs": {}}
                weights = filled(self.server, self.value(message.round))
                store.save_checkpoint(job, Checkpoint(0, message.round + 1, weights, meta))
            broker.ack(delivery)


@pytest.mark.parametrize("alive", [True, False], ids=["worker-alive", "worker-died"])
def test_a_late_replica_reaches_the_published_version(
    backends: tuple[Settings, Backends], alive: bool
) -> None:
    settings, handles = backends
    job = settings.job.name
    store = handles.open_store()
    said = Said()
    logger = logging.getLogger("splitmq.aggregator")
    logger.addHandler(said)
    try:
        ensure_initial_version(store, settings, build_strategy(settings.algorithm.name), LOG)
        for i, (client, n) in enumerate(SAMPLES.items()):
            add_member(store, job, client, samples=n, partition=i)
        declare_all(handles, settings, list(SAMPLES))
        fakes = [FakeClient(c, n, lambda r: 1.0) for c, n in SAMPLES.items()]
        clock = ManualClock()
        worker = LateWorker(store.read_blob(job, 1, SERVER), 0, alive, clock, said)
        sink = ListSink()
        aggregator = Aggregator(settings, handles, sink=sink, clock=clock, poll_s=0.02)
        result: list[list[VersionRecord]] = []
        done = threading.Event()

        def aggregate(stop: threading.Event) -> None:
            result.append(aggregator.run(stop))
            done.set()

        def work(stop: threading.Event) -> None:
            broker, shard_store = handles.open_broker("late-worker"), handles.open_store()
            try:
                worker.run(broker, shard_store, job, stop)
            finally:
                broker.close()
                shard_store.close()

        peers = [client_loop(handles, job, f) for f in fakes]
        with running([*peers, work, aggregate]):
            assert done.wait(WAIT_S), "the aggregator did not finish"
        versions = {v: store.read_blob(job, v, SERVER) for v in (2, 3)}
        manifests = {v: store.manifest(job, v) for v in (2, 3)}
    finally:
        logger.removeHandler(said)
        store.close()

    assert sink.status == "finished"
    assert [(r.round, r.participants) for r in result[0]] == [(1, 2), (2, 2)]
    assert aggregator.stats.late_replicas == 1  # round 1's; round 2's came at once
    # Each version's server side is its round's replica, and counts its samples.
    for version, blob in versions.items():
        for name, tensor in blob.items():
            if tensor.is_floating_point():
                expected = torch.full_like(tensor, LateWorker.value(version - 2))
                torch.testing.assert_close(tensor, expected, msg=f"v{version} {name}")
        assert manifests[version].entries[SERVER].samples == sum(SAMPLES.values())
    # The aggregator said which shard it waits for, and whether a worker serves it.
    assert any("shard 0" in line for line in said.lines), said.lines
    assert any(("w1" in line) == alive for line in said.lines), said.lines
