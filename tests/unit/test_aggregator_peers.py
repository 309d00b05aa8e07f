"""Scripted stand-ins for the peers of the coordinator and the aggregator: clients that answer
assignments with hand-made updates, a worker that hands in a replica on RoundEnd, and a clock
that only moves when told.

No tests here: the coordinator's and aggregator's unit tests (in-memory hub) and their
RabbitMQ + Redis tests share these.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from broker.codec import decode, encode
from broker.messages import (
    Error,
    Message,
    RoundEnd,
    RoundStart,
    WeightsAssignment,
    WeightsUpdate,
    new_message_id,
)
from broker.store import Checkpoint, WeightStore
from broker.topology import (
    CONTROL_EXCHANGE,
    QueueLimits,
    job_queues,
    reply_queue,
    reply_queue_name,
    shard_queue_name,
    updates_routing_key,
)
from broker.transport import Broker, QueueSpec
from services.common.backends import Backends
from services.common.membership import MemberInfo, member_id
from services.config.root import Settings

Tensors = dict[str, torch.Tensor]
WAIT_S = 20.0  # every wait in these tests has this bound: a failure, never a hang


class ManualClock:
    """A monotonic clock the test advances by hand."""

    def __init__(self, start: float = 1000.0) -> None:
        self._now = start
        self._lock = threading.Lock()

    def __call__(self) -> float:
        with self._lock:
            return self._now

    def advance(self, seconds: float) -> None:
        with self._lock:
            self._now += seconds


def make_settings(name: str, /, **sections: Mapping[str, Any]) -> Settings:
    """Small fast defaults (3 clients, 2 rounds, cnn5 on the sample), overridable per section."""
    base: dict[str, dict[str, Any]] = {
        "job": {"name": name, "rounds": 2, "seed": 7},
        "clients": {"count": 3, "min_to_start": 3, "heartbeat_ttl_s": 60.0, "start_timeout_s": 60},
        "rounds": {"deadline_s": 60.0, "quorum": 0.5, "replica_timeout_s": 20.0},
        "data": {"eval_samples": 200},
    }
    for name, values in sections.items():
        base.setdefault(name, {}).update(values)
    return Settings.model_validate(base)


def add_member(
    store: WeightStore,
    job: str,
    client: str,
    *,
    samples: int,
    shard: int = 0,
    partition: int = 0,
    classes: tuple[int, ...] = (),
    ttl_s: float = 60.0,
) -> None:
    """Record a member as the coordinator would."""
    info = MemberInfo(client, shard, "block1", samples, partition, classes, 0.0)
    store.heartbeat(job, member_id(client), ttl_s, info.to_info())


def filled(reference: Mapping[str, torch.Tensor], value: float) -> Tensors:
    return {name: torch.full_like(t, value) for name, t in reference.items()}


def declare_all(backends: Backends, settings: Settings, clients: list[str]) -> None:
    """The job's queues and the clients' reply queues, declared up front from a short handle."""
    broker = backends.open_broker("test-setup")
    try:
        specs: list[QueueSpec] = job_queues(settings.job.name, settings.shards, QueueLimits())
        specs += [reply_queue(settings.job.name, c) for c in clients]
        broker.declare(specs)
    finally:
        broker.close()


def delete_all(backends: Backends, settings: Settings, clients: list[str]) -> None:
    broker = backends.open_broker("test-teardown")
    try:
        names = [s.name for s in job_queues(settings.job.name, settings.shards, QueueLimits())]
        names += [reply_queue_name(settings.job.name, c) for c in clients]
        for name in names:
            broker.delete_queue(name)
    finally:
        broker.close()
    store = backends.open_store()
    try:
        store.delete_job(settings.job.name)
    finally:
        store.close()


# What a fake client sends when it gets an assignment: a list of message bodies.
Script = Callable[["FakeClient", WeightsAssignment], list[bytes]]


@dataclass
class FakeClient:
    """Answers each WeightsAssignment with the bodies its script returns; stops when told the
    job is finished."""

    client: str
    samples: int
    value: Callable[[int], float]  # round → the value every tensor of its update holds
    script: Script | None = None
    received: list[Message] = field(default_factory=list)
    sent: int = 0
    published: threading.Event = field(default_factory=threading.Event)

    def update(self, assignment: WeightsAssignment, value: float | None = None) -> WeightsUpdate:
        v = self.value(assignment.round) if value is None else value
        return WeightsUpdate(
            job=assignment.job,
            client=self.client,
            message_id=new_message_id(),
            version=assignment.version,
            round=assignment.round,
            samples=self.samples,
            client_weights=filled(assignment.client_weights, v),
            aux_weights={},
            metrics={
                "train_loss": 1.0 + v,
                "train_samples": self.samples / 2,  # e.g. max_steps_per_round cut it short
                "bytes_up": 1000.0,
                "bytes_down": 2000.0,
            },
        )

    def answer(self, assignment: WeightsAssignment) -> list[bytes]:
        if self.script is not None:
            return self.script(self, assignment)
        return [encode(self.update(assignment))]

    def errors(self) -> list[Error]:
        return [m for m in self.received if isinstance(m, Error)]

    def assignments(self) -> list[WeightsAssignment]:
        return [m for m in self.received if isinstance(m, WeightsAssignment)]

    def run(self, broker: Broker, job: str, stop: threading.Event) -> None:
        broker.subscribe(reply_queue_name(job, self.client), prefetch=8)
        while not stop.is_set():
            delivery = broker.get(0.05)
            if delivery is None:
                continue
            message = decode(delivery.body)
            self.received.append(message)
            broker.ack(delivery)
            if not isinstance(message, WeightsAssignment):
                continue
            if not message.participate:
                return
            for body in self.answer(message):
                broker.publish(CONTROL_EXCHANGE, updates_routing_key(job), body)
                self.sent += 1
            self.published.set()


@dataclass
class FakeWorker:
    """Hands in a replica whose tensors all hold `value(round)` when a RoundEnd arrives."""

    server: Tensors  # the shape of the server side (version 1's server blob)
    value: Callable[[int], float]
    starts: list[RoundStart] = field(default_factory=list)
    ends: list[RoundEnd] = field(default_factory=list)

    def run(
        self, broker: Broker, store: WeightStore, job: str, shards: int, stop: threading.Event
    ) -> None:
        for shard in range(shards):
            broker.subscribe(shard_queue_name(job, shard), prefetch=8)
        samples: dict[int, int] = {}
        while not stop.is_set():
            delivery = broker.get(0.05)
            if delivery is None:
                continue
            message = decode(delivery.body)
            if isinstance(message, RoundStart):
                self.starts.append(message)
                samples[message.shard] = sum(int(n) for n in message.participants.values())
            elif isinstance(message, RoundEnd):
                self.ends.append(message)
                meta = {
                    "version": message.version,
                    "round": message.round,
                    "round_samples": samples.get(message.shard, 0),
                    "seqs": {},
                }
                weights = filled(self.server, self.value(message.round))
                store.save_checkpoint(job, Checkpoint(message.shard, 1, weights, meta))
            broker.ack(delivery)


@contextmanager
def running(targets: list[Callable[[threading.Event], object]]) -> Iterator[threading.Event]:
    """Run each target(stop) in a thread; on exit set stop and join them all."""
    stop = threading.Event()
    errors: list[BaseException] = []

    def guard(target: Callable[[threading.Event], object]) -> None:
        try:
            target(stop)
        except BaseException as exc:  # surfaced in the test below
            errors.append(exc)
            stop.set()

    threads = [threading.Thread(target=guard, args=(t,), daemon=True) for t in targets]
    for thread in threads:
        thread.start()
    try:
        yield stop
    finally:
        stop.set()
        for thread in threads:
            thread.join(WAIT_S)
    alive = [t for t in threads if t.is_alive()]
    assert not alive, f"{len(alive)} peer threads did not stop"
    if errors:
        raise errors[0]


def client_loop(
    backends: Backends, job: str, fake: FakeClient
) -> Callable[[threading.Event], None]:
    def target(stop: threading.Event) -> None:
        broker = backends.open_broker(f"fake-{fake.client}")
        try:
            fake.run(broker, job, stop)
        finally:
            broker.close()

    return target


def worker_loop(
    backends: Backends, job: str, shards: int, fake: FakeWorker
) -> Callable[[threading.Event], None]:
    def target(stop: threading.Event) -> None:
        broker = backends.open_broker("fake-worker")
        store = backends.open_store()
        try:
            fake.run(broker, store, job, shards, stop)
        finally:
            broker.close()
            store.close()

    return target
