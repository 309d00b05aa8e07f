"""Exactness: the real roles, wired through a broker and a store, train the very weights a
plain in-process PyTorch loop does (tests/integration/reference_loops.py).

Coordinator, aggregator, one worker and the clients run on threads of this process, each
with its own broker handle, over real RabbitMQ + Redis and over the embedded in-memory
backends. The final version's `client/global` and `server/global`, read back from the store,
must equal the reference to 1e-5: a batch applied twice or dropped, a wrong averaging weight,
a stale gradient, optimizer state carried across versions or batches in another order all
move the weights by far more than that.

The U-shaped runs (`model.tail`) also tap the shard queue: a queue bound beside it receives a
copy of everything the clients publish there, and not one SmashedBatch may carry labels.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch.nn import functional as F

from broker.codec import decode
from broker.messages import SmashedBatch, TailGradient
from broker.store import CLIENT_PART, SERVER_PART, BlobRef
from broker.topology import SMASHED_EXCHANGE, shard_routing_key
from broker.transport import QueueSpec
from services.aggregator.aggregator import Aggregator
from services.client.client import Client
from services.client.data import JobData
from services.client.stats import ClientStats
from services.common.backends import Backends, Embedded
from services.common.supervise import Role, RoleSpec, Supervisor
from services.config.root import Settings
from services.coordinator.coordinator import Coordinator
from services.data.loaders import Dataset, load_dataset
from services.report.records import ListSink
from tests.integration.reference_loops import Recipe, ReferenceResult, reference_run
from tests.unit.test_aggregator_peers import delete_all
from tests.unit.test_client_peers import max_diff
from tests.unit.test_worker_support import one_torch_thread
from workers.stats import WorkerStats
from workers.worker import Worker

__all__ = ["one_torch_thread"]  # the autouse fixture, imported so that it applies here

pytestmark = pytest.mark.slow

TOLERANCE = 1e-5
ROUNDS = 2
RUN_LIMIT_S = 60.0  # a hung run fails here, not at pytest's timeout


@pytest.fixture(scope="module")
def dataset() -> Dataset:
    return load_dataset("fashion_mnist_sample", None)


@pytest.fixture(
    params=[
        "embedded",
        pytest.param("rabbitmq", marks=[pytest.mark.rabbitmq, pytest.mark.redis]),
    ]
)
def connections(request: pytest.FixtureRequest) -> dict[str, dict[str, Any]]:
    """The `[broker]` and `[store]` sections of one backend kind."""
    if request.param == "embedded":
        return {"broker": {"kind": "memory"}, "store": {"kind": "memory"}}
    amqp_url = request.getfixturevalue("amqp_url")
    redis_url = request.getfixturevalue("redis_url")
    return {
        "broker": {"kind": "rabbitmq", "amqp_url": amqp_url},
        "store": {"kind": "redis", "redis_url": redis_url},
    }


def job_settings(
    job: str,
    connections: dict[str, dict[str, Any]],
    *,
    algorithm: str,
    clients: int,
    tail: str = "",
    recipe: dict[str, Any] | None = None,
    **data: Any,
) -> Settings:
    """cnn5 cut after block1 (BatchNorm on both sides), momentum (so optimizer state shows),
    two local epochs capped at 3 steps a round (so round 1 must start at epoch 2); `tail`:
    U-shaped from that block on; `recipe`: its [optimizer], [schedule] and [loss] instead of
    the SGD settings."""
    sgd = {"lr": 0.05, "server_lr": 0.08, "momentum": 0.9} if recipe is None else {}
    return Settings.model_validate(
        {
            **connections,
            **(recipe or {}),
            "job": {"name": job, "seed": 1, "rounds": ROUNDS},
            "model": {"name": "cnn5", "cut": "block1", "tail": tail},
            "data": {"dataset": "fashion_mnist_sample", **data},
            "algorithm": {
                "name": algorithm,
                "batch_size": 16,
                **sgd,
                "local_epochs": 2,
                "max_steps_per_round": 3,
            },
            # Liveness bounds far above any step on a loaded machine: a member expiring or the
            # step barrier giving up on a slow client would change the training, not just time.
            "clients": {
                "count": clients,
                "min_to_start": clients,
                "heartbeat_s": 0.5,
                "heartbeat_ttl_s": 60.0,
            },
            # CPU: this test is about message semantics at 1e-5; a CUDA worker's arithmetic
            # (TF32 convolutions, other reduction orders) differs by more (test_cuda_worker.py).
            "workers": {"step_barrier_timeout_s": 2 * RUN_LIMIT_S, "device": "cpu"},
        }
    )


@dataclass
class Kept:
    """A role whose `run` result the test reads afterwards (the supervisor keeps only the
    aggregator's)."""

    role: Role
    result: object = None

    def run(self, stop: threading.Event) -> object:
        self.result = self.role.run(stop)
        return self.result


@dataclass(frozen=True)
class Trained:
    initial: dict[str, torch.Tensor]  # version 1, both sides
    client: dict[str, torch.Tensor]
    server: dict[str, torch.Tensor]
    versions: list[int]
    worker: WorkerStats
    clients: list[ClientStats]


@pytest.fixture
def cleanup() -> Iterator[list[tuple[Backends, Settings]]]:
    """The jobs a test registers here lose their queues and keys afterwards."""
    opened: list[tuple[Backends, Settings]] = []
    yield opened
    for backends, settings in opened:
        clients = [f"client-{i}" for i in range(settings.clients.count)]
        delete_all(backends, settings, clients)


def train(settings: Settings, backends: Backends, dataset: Dataset) -> Trained:
    """Every role of the job on its own thread until the job finishes; the final version."""
    job = settings.job.name
    shared = JobData(settings, dataset)
    sink = ListSink()
    worker = Kept(Worker(settings, backends, worker_id="worker-0", poll_s=0.05))
    clients = [
        Kept(
            Client(settings, backends, client_id=f"client-{i}", partition=i, dataset=shared),
        )
        for i in range(settings.clients.count)
    ]
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
    limit.start()
    try:
        outcome = Supervisor(roles, stop, client_grace_s=10.0, join_timeout_s=20.0).run()
    finally:
        limit.cancel()
    assert outcome.ok, f"{outcome.status}\n{outcome.traceback}"
    assert not outcome.stuck, outcome.stuck
    assert sink.status == "finished"
    assert [r.version for r in sink.records] == [v + 2 for v in range(ROUNDS)]
    assert all(r.participants == settings.clients.count for r in sink.records), sink.records
    store = backends.open_store()
    try:
        versions = store.versions(job)
        final = store.current_version(job)
        initial = {
            **store.read_blob(job, 1, BlobRef(CLIENT_PART)),
            **store.read_blob(job, 1, BlobRef(SERVER_PART)),
        }
        client = store.read_blob(job, final, BlobRef(CLIENT_PART))
        server = store.read_blob(job, final, BlobRef(SERVER_PART))
    finally:
        store.close()
    assert isinstance(worker.result, WorkerStats)
    client_stats = [c.result for c in clients if isinstance(c.result, ClientStats)]
    assert len(client_stats) == len(clients)
    return Trained(initial, client, server, versions, worker.result, client_stats)


def check_exact(trained: Trained, want: ReferenceResult, clients: int) -> None:
    assert trained.versions[-1] == ROUNDS + 1, trained.versions
    # Version 1 is the seeded model: the one thing both runs share before training.
    assert max_diff(trained.initial, want.initial) == 0.0, "version 1 is not the seeded model"
    stats = trained.worker
    # Every batch applied exactly once, one server step per cohort step.
    assert stats.steps == want.steps, stats
    assert stats.batches_applied == want.steps * clients, stats
    assert stats.dead_lettered_total == 0 and stats.rollbacks == 0, stats
    for s in trained.clients:
        assert s.finished and s.rounds == ROUNDS and s.rounds_aborted == 0, s
    client_diff = max_diff(trained.client, want.client)
    server_diff = max_diff(trained.server, want.server)
    assert client_diff <= TOLERANCE, f"client/global differs from the reference by {client_diff}"
    assert server_diff <= TOLERANCE, f"server/global differs from the reference by {server_diff}"


def test_sfl_v2_with_one_client_matches_a_plain_loop(
    job: str,
    connections: dict[str, dict[str, Any]],
    dataset: Dataset,
    cleanup: list[tuple[Backends, Settings]],
) -> None:
    settings = job_settings(job, connections, algorithm="sfl_v2", clients=1)
    backends = Backends(settings.broker, settings.store, Embedded())
    cleanup.append((backends, settings))

    trained = train(settings, backends, dataset)
    want = reference_run(settings, dataset, ROUNDS)

    assert want.steps == ROUNDS * settings.algorithm.max_steps_per_round
    check_exact(trained, want, clients=1)


def test_minibatch_sfl_with_three_clients_matches_equation_3(
    job: str,
    connections: dict[str, dict[str, Any]],
    dataset: Dataset,
    cleanup: list[tuple[Backends, Settings]],
) -> None:
    # Dirichlet: unequal |D_n| (1481 / 2227 / 2292 samples), so p_n matters both in the
    # server step and in the client average.
    settings = job_settings(
        job, connections, algorithm="minibatch_sfl", clients=3, partition="dirichlet", alpha=0.5
    )
    backends = Backends(settings.broker, settings.store, Embedded())
    cleanup.append((backends, settings))
    sizes = [len(JobData(settings, dataset).indices(i)) for i in range(3)]
    assert len(set(sizes)) == 3, f"equal partitions {sizes} would not test the weights p_n"

    trained = train(settings, backends, dataset)
    want = reference_run(settings, dataset, ROUNDS)

    assert want.steps == ROUNDS * settings.algorithm.max_steps_per_round
    check_exact(trained, want, clients=3)


# AdamW with weight decay on both sides, each with its own lr and schedule (the client's per
# step across rounds, the server's per round), and label smoothing: what `adamw_reference`
# writes out by hand. Halving schedules keep every lr exact in binary. eps is raised from
# 1e-8: a gradient that is zero in exact arithmetic (a conv's bias before BatchNorm) is float
# noise of about that size, which Adam would scale up to lr-sized steps, so that two correct
# loops summing the cohort's losses in another order would part by ~lr there.
ADAMW_RECIPE: dict[str, Any] = {
    "optimizer": {
        "name": "adamw",
        "lr": 0.004,
        "weight_decay": 0.05,
        "betas": [0.9, 0.99],
        "eps": 1e-4,
        "server": {"name": "AdamW", "lr": 0.002, "weight_decay": 0.1, "eps": 1e-4},
    },
    "schedule": {
        "name": "steplr",
        "step_size": 1,
        "gamma": 0.5,
        "every": "step",
        "server": {"name": "exponentiallr", "gamma": 0.5},
    },
    "loss": {"label_smoothing": 0.1},
}


def adamw_reference(steps: int) -> Recipe:
    return Recipe(
        client=lambda ps: torch.optim.AdamW(
            ps, lr=0.004, weight_decay=0.05, betas=(0.9, 0.99), eps=1e-4
        ),
        server=lambda ps: torch.optim.AdamW(ps, lr=0.002, weight_decay=0.1, eps=1e-4),
        client_lr=lambda r, i: 0.004 * 0.5 ** (r * steps + i),
        server_lr=lambda r, _i: 0.002 * 0.5**r,
        loss=lambda logits, y: F.cross_entropy(logits, y, label_smoothing=0.1),
    )


def test_sfl_v2_with_adamw_a_schedule_and_label_smoothing_matches_a_plain_loop(
    job: str,
    connections: dict[str, dict[str, Any]],
    dataset: Dataset,
    cleanup: list[tuple[Backends, Settings]],
) -> None:
    settings = job_settings(job, connections, algorithm="sfl_v2", clients=1, recipe=ADAMW_RECIPE)
    backends = Backends(settings.broker, settings.store, Embedded())
    cleanup.append((backends, settings))

    trained = train(settings, backends, dataset)
    steps = settings.algorithm.max_steps_per_round
    want = reference_run(settings, dataset, ROUNDS, adamw_reference(steps))

    check_exact(trained, want, clients=1)
    # The recipe mattered: plain SGD lands elsewhere.
    sgd = reference_run(
        job_settings(job, connections, algorithm="sfl_v2", clients=1), dataset, ROUNDS
    )
    assert max_diff(trained.server, sgd.server) > 1e-3


@dataclass
class ShardTap:
    """A queue bound beside each shard queue: a copy of every message published to a shard."""

    backends: Backends
    names: list[str]

    @classmethod
    def declare(cls, backends: Backends, job: str, shards: int) -> ShardTap:
        specs = [
            QueueSpec(f"{job}.tap.{s}", SMASHED_EXCHANGE, shard_routing_key(job, s))
            for s in range(shards)
        ]
        broker = backends.open_broker("test-tap")
        try:
            broker.declare(specs)
        finally:
            broker.close()
        return cls(backends, [spec.name for spec in specs])

    def messages(self) -> list[object]:
        """Everything tapped, decoded; the tap queues are deleted after."""
        broker = self.backends.open_broker("test-tap-read")
        out: list[object] = []
        try:
            for name in self.names:
                broker.subscribe(name, prefetch=1000)
            while (delivery := broker.get(0.5)) is not None:
                broker.ack(delivery)
                out.append(decode(delivery.body))
            for name in self.names:
                broker.delete_queue(name)
        finally:
            broker.close()
        return out


def check_no_labels_left(tapped: list[object], batches: int) -> None:
    """Every SmashedBatch was sent without labels, and each had its tail gradient."""
    smashed = [m for m in tapped if isinstance(m, SmashedBatch)]
    tails = [m for m in tapped if isinstance(m, TailGradient)]
    assert len(smashed) >= batches, f"tapped {len(smashed)} SmashedBatches, sent {batches}"
    leaked = [(m.client, m.seq) for m in smashed if m.labels is not None]
    assert not leaked, f"SmashedBatches with labels left the clients: {leaked}"
    assert {(m.client, m.seq) for m in tails} == {(m.client, m.seq) for m in smashed}


def test_u_shaped_sfl_v2_with_one_client_matches_a_plain_loop(
    job: str,
    connections: dict[str, dict[str, Any]],
    dataset: Dataset,
    cleanup: list[tuple[Backends, Settings]],
) -> None:
    """The acceptance test of the U-shaped split (over RabbitMQ in its rabbitmq variant): no
    label leaves the client, and the weights, tail included, are the in-process loop's."""
    settings = job_settings(job, connections, algorithm="sfl_v2", clients=1, tail="block3")
    backends = Backends(settings.broker, settings.store, Embedded())
    cleanup.append((backends, settings))
    tap = ShardTap.declare(backends, job, settings.shards)

    trained = train(settings, backends, dataset)
    want = reference_run(settings, dataset, ROUNDS)

    assert want.steps == ROUNDS * settings.algorithm.max_steps_per_round
    # The tail's blocks travel with the client side; the server holds only block2.
    assert {n.split(".")[1] for n in trained.client} == {"0", "2", "3"}, sorted(trained.client)
    assert {n.split(".")[1] for n in trained.server} == {"1"}, sorted(trained.server)
    check_exact(trained, want, clients=1)
    check_no_labels_left(tap.messages(), want.steps)


@pytest.mark.parametrize("adamw", [False, True], ids=["sgd", "adamw"])
def test_u_shaped_minibatch_sfl_with_three_clients_matches_equation_3(
    job: str, dataset: Dataset, cleanup: list[tuple[Backends, Settings]], adamw: bool
) -> None:
    """`adamw`: with ADAMW_RECIPE, whose loss trains the clients' tails too."""
    connections = {"broker": {"kind": "memory"}, "store": {"kind": "memory"}}
    settings = job_settings(
        job,
        connections,
        algorithm="minibatch_sfl",
        clients=3,
        tail="classifier",
        recipe=ADAMW_RECIPE if adamw else None,
        partition="dirichlet",
        alpha=0.5,
    )
    backends = Backends(settings.broker, settings.store, Embedded())
    cleanup.append((backends, settings))
    tap = ShardTap.declare(backends, job, settings.shards)

    trained = train(settings, backends, dataset)
    steps = settings.algorithm.max_steps_per_round
    want = reference_run(settings, dataset, ROUNDS, adamw_reference(steps) if adamw else None)

    check_exact(trained, want, clients=3)
    check_no_labels_left(tap.messages(), want.steps * 3)


def test_u_shaped_sharded_sfl_trains_end_to_end(
    job: str, dataset: Dataset, cleanup: list[tuple[Backends, Settings]]
) -> None:
    """Two shards of two clients each (their batches interleave on a shard, so no plain loop
    to match): every batch is applied once in a step of its own, tails are trained and
    averaged on the client side, and no label leaves a client."""
    connections = {"broker": {"kind": "memory"}, "store": {"kind": "memory"}}
    settings = job_settings(job, connections, algorithm="sfl", clients=4, tail="block3")
    settings = settings.model_copy(
        update={"algorithm": settings.algorithm.model_copy(update={"shards": 2})}
    )
    assert settings.shards == 2
    backends = Backends(settings.broker, settings.store, Embedded())
    cleanup.append((backends, settings))
    tap = ShardTap.declare(backends, job, settings.shards)

    trained = train(settings, backends, dataset)

    batches = 4 * ROUNDS * settings.algorithm.max_steps_per_round
    stats = trained.worker
    assert stats.batches_applied == batches and stats.steps == batches, stats
    assert stats.dead_lettered_total == 0 and stats.rollbacks == 0, stats
    for s in trained.clients:
        assert s.finished and s.rounds == ROUNDS and s.rounds_aborted == 0, s
    tail = [n for n in trained.client if n.startswith(("blocks.2.", "blocks.3."))]
    assert tail and not any(n.startswith(("blocks.2.", "blocks.3.")) for n in trained.server)
    moved = max_diff({n: trained.client[n] for n in tail}, {n: trained.initial[n] for n in tail})
    assert moved > 1e-3, "the clients' tails did not train"
    check_no_labels_left(tap.messages(), batches)
