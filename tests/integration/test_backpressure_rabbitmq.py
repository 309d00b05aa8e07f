"""Back-pressure over the real RabbitMQ and Redis (design §6, issue 5 item 4): a shard queue
bounded at a few messages refuses the clients' publishes (reject-publish), the clients back off
and retry, and the job still finishes with every batch applied exactly once.

The job is local-loss SFL, whose clients publish activations without waiting for a gradient,
so only the bound holds them back. The worker starts only once a client has been refused and
the shard queue was seen full, so the refusal does not depend on who is faster. A probe polls
the queue's depth throughout. `benchmarks/backpressure_memory.py` is the long version, with
every role its own process and their memory sampled (docs/reliability.md).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from broker.codec import decode
from broker.errors import BackPressureError, BrokerError
from broker.messages import SmashedBatch
from broker.topology import SMASHED_EXCHANGE, shard_queue_name
from broker.transport import Broker
from services.aggregator.aggregator import Aggregator
from services.client.client import Client
from services.client.data import JobData
from services.client.stats import ClientStats
from services.common.backends import Backends
from services.common.supervise import RoleSpec, Supervisor
from services.config.root import Settings
from services.coordinator.coordinator import Coordinator
from services.data.loaders import load_dataset
from services.report.records import ListSink
from tests.integration.test_exactness import Kept
from tests.unit.test_aggregator_peers import delete_all
from tests.unit.test_worker_support import one_torch_thread
from workers.replica import AUDIT_MODULUS
from workers.stats import WorkerStats
from workers.worker import Worker

__all__ = ["one_torch_thread"]  # the autouse fixture, imported so that it applies here

pytestmark = [pytest.mark.rabbitmq, pytest.mark.redis, pytest.mark.slow]

BOUND = 2  # messages the shard queue holds: a RoundStart marker and one batch
CLIENTS = 3
ROUNDS = 2
STEPS = 10
GATE_S = 30.0  # the worker gives up waiting for the first refusal
RUN_LIMIT_S = 90.0  # a hung run fails here, not at pytest's timeout


@pytest.fixture
def settings(job: str, amqp_url: str, redis_url: str) -> Iterator[Settings]:
    settings = Settings.model_validate(
        {
            "broker": {"kind": "rabbitmq", "amqp_url": amqp_url, "shard_queue_max_length": BOUND},
            "store": {"kind": "redis", "redis_url": redis_url},
            "job": {"name": job, "seed": 0, "rounds": ROUNDS},
            "model": {"name": "cnn5", "cut": "block1"},
            "data": {"dataset": "fashion_mnist_sample", "partition": "iid"},
            "algorithm": {
                "name": "local_loss_sfl",
                "batch_size": 16,
                "lr": 0.05,
                "max_steps_per_round": STEPS,
            },
            "clients": {
                "count": CLIENTS,
                "min_to_start": CLIENTS,
                "heartbeat_s": 0.5,
                "heartbeat_ttl_s": 60.0,
            },
            # Refused clients are slow on purpose: no round may close on them.
            "rounds": {"deadline_s": 120.0, "quorum": 1.0},
            "workers": {"checkpoint_every_steps": 5},
            "report": {"plots": False},
        }
    )
    yield settings
    backends = Backends(settings.broker, settings.store)
    delete_all(backends, settings, [f"client-{i}" for i in range(CLIENTS)])


class Ledger:
    """What the clients' publishes of SmashedBatches came to: refusals, and the batches that
    RabbitMQ took, as (client, seq)."""

    def __init__(self) -> None:
        self.refused = threading.Event()
        self.refusals = 0
        self.sent: list[tuple[str, int]] = []
        self._lock = threading.Lock()

    def note(self, body: bytes, taken: bool) -> None:
        batch = decode(body)
        assert isinstance(batch, SmashedBatch)
        with self._lock:
            if taken:
                self.sent.append((batch.client, batch.seq))
            else:
                self.refusals += 1
                self.refused.set()


class LedgerBroker:
    """A client's broker handle that reports its SmashedBatch publishes to the ledger."""

    def __init__(self, inner: Broker, ledger: Ledger) -> None:
        self._inner = inner
        self._ledger = ledger

    def publish(self, exchange: str, routing_key: str, body: bytes, *rest: Any) -> None:
        if exchange != SMASHED_EXCHANGE:
            self._inner.publish(exchange, routing_key, body, *rest)
            return
        try:
            self._inner.publish(exchange, routing_key, body, *rest)
        except BackPressureError:
            self._ledger.note(body, taken=False)
            raise
        self._ledger.note(body, taken=True)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


@dataclass(frozen=True)
class LedgerBackends(Backends):
    ledger: Ledger = field(default_factory=Ledger)

    def open_broker(self, name: str = "", **kwargs: Any) -> Broker:
        inner = super().open_broker(name, **kwargs)
        return LedgerBroker(inner, self.ledger)


class DepthProbe(threading.Thread):
    """Polls the shard queue's depth on its own connection; `full` once it reached `bound`."""

    def __init__(self, backends: Backends, queue: str, bound: int) -> None:
        super().__init__(name="depth-probe", daemon=True)
        self._broker = backends.open_broker("test-depth-probe")
        self._queue = queue
        self._bound = bound
        self.highest = 0
        self.polls = 0
        self.full = threading.Event()
        self.halt = threading.Event()

    def run(self) -> None:
        try:
            while not self.halt.wait(0.01):
                try:
                    depth = self._broker.queue_depth(self._queue)
                except BrokerError:
                    continue  # not declared yet
                self.polls += 1
                self.highest = max(self.highest, depth)
                if depth >= self._bound:
                    self.full.set()
        finally:
            self._broker.close()


class GatedWorker:
    """A worker that starts once `gates` are all set: the clients have met back-pressure."""

    def __init__(self, worker: Worker, *gates: threading.Event) -> None:
        self._worker = worker
        self._gates = gates
        self.result: object = None

    def run(self, stop: threading.Event) -> object:
        for gate in self._gates:
            if not gate.wait(GATE_S):
                raise AssertionError("the clients were never refused: no back-pressure")
        self.result = self._worker.run(stop)
        return self.result


def test_refused_clients_retry_and_every_batch_is_applied_once(settings: Settings) -> None:
    job = settings.job.name
    backends = Backends(settings.broker, settings.store)
    spied = LedgerBackends(settings.broker, settings.store)
    ledger = spied.ledger
    probe = DepthProbe(backends, shard_queue_name(job, 0), BOUND)
    shared = JobData(settings, load_dataset("fashion_mnist_sample", None))
    worker = GatedWorker(
        Worker(settings, backends, worker_id="worker-0", poll_s=0.05), ledger.refused, probe.full
    )
    clients = [
        Kept(Client(settings, spied, client_id=f"client-{i}", partition=i, dataset=shared))
        for i in range(CLIENTS)
    ]
    sink = ListSink()
    roles = [
        RoleSpec(
            "aggregator", "aggregator", Aggregator(settings, backends, sink=sink, poll_s=0.05)
        ),
        RoleSpec("coordinator", "coordinator", Coordinator(settings, backends, poll_s=0.05)),
        RoleSpec("worker-0", "worker", worker),
        *(RoleSpec(f"client-{i}", "client", c) for i, c in enumerate(clients)),
    ]
    stop = threading.Event()
    limit = threading.Timer(RUN_LIMIT_S, stop.set)
    probe.start()
    limit.start()
    try:
        outcome = Supervisor(roles, stop, client_grace_s=10.0, join_timeout_s=20.0).run()
    finally:
        limit.cancel()
        probe.halt.set()
        probe.join(10.0)
    assert outcome.ok, f"{outcome.status}\n{outcome.traceback}"
    assert sink.status == "finished"
    assert len(sink.records) == ROUNDS

    # The clients were refused, retried and finished every round.
    stats = [kept.result for kept in clients]
    assert all(isinstance(s, ClientStats) for s in stats)
    client_stats = [s for s in stats if isinstance(s, ClientStats)]
    assert ledger.refusals > 0
    assert sum(s.backpressure_retries for s in client_stats) == ledger.refusals
    for s in client_stats:
        assert s.finished and s.rounds == ROUNDS and s.rounds_aborted == 0, s
        assert s.batches_sent == ROUNDS * STEPS, s

    # The bound held: RabbitMQ never queued more than it, and the queue did fill up.
    assert probe.polls > 0 and probe.highest == BOUND

    # Sent == applied, per client, and each seq exactly once (the audit's seq sums).
    worker_stats = worker.result
    assert isinstance(worker_stats, WorkerStats)
    assert worker_stats.dead_lettered_total == 0, worker_stats
    assert worker_stats.batches_applied == CLIENTS * ROUNDS * STEPS
    store = backends.open_store()
    try:
        checkpoint = store.load_checkpoint(job, 0)
    finally:
        store.close()
    assert checkpoint is not None
    # Every batch RabbitMQ took was taken once: a refused one was not enqueued.
    assert len(ledger.sent) == len(set(ledger.sent)) == CLIENTS * ROUNDS * STEPS
    assert checkpoint.applied == len(ledger.sent)
    expected: dict[str, list[int]] = {}
    for client, seq in ledger.sent:
        count, seq_sum = expected.get(client, [0, 0])
        expected[client] = [count + 1, (seq_sum + seq) % AUDIT_MODULUS]
    assert checkpoint.meta["audit"] == expected
