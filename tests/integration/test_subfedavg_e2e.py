"""Sub-FedAvg end to end over real RabbitMQ and Redis: every role on its own thread with its
own connections, as in a deployment, training cnn5 on two-label clients of the shipped sample.

Checked: the job finishes; the personalised models (the global model under each client's
mask) beat, on the clients' local test sets, a floor and the same version's shared global
model (a paired baseline: the run's own noise hits both); the clients' pruned models are
reported per client; the masks reached a real sparsity and cut FLOPs; the published
personal blobs are pruned where the global model is not. The full-model scope (FL, as in the
paper, unstructured) and the split client side (hybrid, SFL-V2 server) each run once.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from broker.store import CLIENT_PART, GLOBAL_OWNER, BlobRef, WeightStore
from services.aggregator.core import read_version
from services.aggregator.evaluation import build_evaluator
from services.client.data import JobData
from services.common.backends import Backends, Embedded
from services.common.supervise import Supervisor
from services.config.root import Settings
from services.data.loaders import Dataset, load_dataset
from services.report.records import ListSink
from services.runtime.roles import embedded_roles
from tests.unit.test_aggregator_peers import delete_all
from tests.unit.test_worker_support import one_torch_thread

__all__ = ["one_torch_thread"]  # the autouse fixture, imported so that it applies here

pytestmark = [pytest.mark.slow, pytest.mark.rabbitmq, pytest.mark.redis]

ROUNDS = 4
CLIENTS = 4
RUN_LIMIT_S = 150.0
# Two labels per client: its local test set has two classes, the model predicts among ten.
# Measured personal accuracy of the last version (job seed 0, OMP_NUM_THREADS=1, the 2-core
# machine shared with other work, load 1-21): full scope 0.867 in 5 of 5 runs (FL only:
# deterministic); hybrid/client 0.625-0.849 over 37 runs (mean 0.79) and 0.66 once in CI. Its
# SFL-V2 server trains on the four clients' smashed batches in arrival order, which thread
# timing decides, and one client's swings by 0.2-0.4 between runs. So the hybrid floor only says
# "tells its two labels apart" (guessing between them scores 0.5); the paired check below is
# the one that needs Sub-FedAvg to work.
PERSONAL_FLOOR = {"full": 0.75, "client": 0.55}
# Personalised minus shared global accuracy on the same local test sets, same version, must be
# above 0. Measured: full 0.28 (every run); hybrid 0.027-0.304 over 32 runs (mean 0.17). Broken
# masks fail it: with no personalisation it is exactly 0, and with each client evaluated under
# another client's mask it was -0.29 to -0.038 in 22 of those runs.
GLOBAL_FLOOR = 0.2  # chance is 0.1; pathological non-IID keeps the global model modest


def settings_for(job: str, amqp_url: str, redis_url: str, mode: str, scope: str) -> Settings:
    return Settings.model_validate(
        {
            "broker": {"kind": "rabbitmq", "amqp_url": amqp_url},
            "store": {"kind": "redis", "redis_url": redis_url},
            "job": {"name": job, "seed": 0, "rounds": ROUNDS},
            "model": {"name": "cnn5", "cut": "block1"},
            "data": {
                "dataset": "fashion_mnist_sample",
                "partition": "shards",
                "shards_per_client": 2,
                "shard_size": 250,
            },
            "algorithm": {
                "name": "subfedavg",
                "batch_size": 10,
                "lr": 0.02,
                "momentum": 0.5,
                "local_epochs": 2,
                "max_steps_per_round": 40,
                "subfedavg": {
                    "mode": mode,
                    "scope": scope,
                    "prune_percent": 0.2,
                    "target": 0.5,
                    "acc_thresh": 0.6,
                },
            },
            "clients": {
                "count": CLIENTS,
                "min_to_start": CLIENTS,
                "heartbeat_s": 0.5,
                "heartbeat_ttl_s": 60.0,
            },
            "rounds": {"deadline_s": 120.0},
            "report": {"plots": False},
        }
    )


@pytest.fixture(scope="module")
def dataset() -> Dataset:
    return load_dataset("fashion_mnist_sample", None)


@pytest.fixture
def cleanup() -> Iterator[list[tuple[Backends, Settings]]]:
    opened: list[tuple[Backends, Settings]] = []
    yield opened
    for backends, settings in opened:
        delete_all(backends, settings, [f"client-{i}" for i in range(settings.clients.count)])


def local_accuracies(
    store: WeightStore, settings: Settings, dataset: Dataset
) -> tuple[float, float]:
    """Mean accuracy on the clients' local test sets of the last version's personalised models,
    and of its shared global model alone."""
    job = settings.job.name
    blobs = read_version(store, job, store.current_version(job))
    data = JobData(settings, dataset)
    classes = {f"client-{i}": data.classes(i) for i in range(settings.clients.count)}
    evaluator = build_evaluator(settings, dataset.test)
    shared = {ref: weights for ref, weights in blobs.items() if ref.owner == GLOBAL_OWNER}
    return (
        evaluator.evaluate(blobs, classes).personal_accuracy,
        evaluator.evaluate(shared, classes).personal_accuracy,
    )


@pytest.mark.timeout(240)
@pytest.mark.parametrize(("mode", "scope"), [("unstructured", "full"), ("hybrid", "client")])
def test_subfedavg_learns_and_prunes_over_rabbitmq_and_redis(
    mode: str,
    scope: str,
    job: str,
    amqp_url: str,
    redis_url: str,
    dataset: Dataset,
    cleanup: list[tuple[Backends, Settings]],
) -> None:
    settings = settings_for(job, amqp_url, redis_url, mode, scope)
    backends = Backends(settings.broker, settings.store, Embedded())
    cleanup.append((backends, settings))
    sink = ListSink()
    stop = threading.Event()
    limit = threading.Timer(RUN_LIMIT_S, stop.set)
    limit.start()
    try:
        roles = embedded_roles(settings, backends, sink, dataset)
        outcome = Supervisor(roles, stop, client_grace_s=10.0, join_timeout_s=20.0).run()
    finally:
        limit.cancel()
    assert outcome.ok, f"{outcome.status}\n{outcome.traceback}"
    assert sink.status == "finished"
    records = sink.records
    assert [r.version for r in records] == [v + 2 for v in range(ROUNDS)]
    last = records[-1]
    floor = PERSONAL_FLOOR[scope]
    assert last.personal_accuracy > floor, [r.personal_accuracy for r in records]
    assert last.global_accuracy > GLOBAL_FLOOR, [r.global_accuracy for r in records]

    extra: dict[str, Any] = last.extra
    clients = [f"client-{i}" for i in range(CLIENTS)]
    assert all(f"param_reduction.{c}" in extra for c in clients), sorted(extra)
    assert 0.0 < extra["param_reduction"] <= 0.75
    assert extra["flop_reduction"] > 0.0
    if scope == "full":
        assert extra["local_accuracy"] > floor
    else:
        assert extra["channel_reduction"] > 0.0

    store = backends.open_store()
    try:
        personal, shared_only = local_accuracies(store, settings, dataset)
        final = store.current_version(job)
        shared = store.read_blob(job, final, BlobRef(CLIENT_PART))
        # Whether a given client prunes depends on its accuracy gate, which for the split
        # scope reads the training accuracy of batches whose order thread timing decides: the
        # client that pruned most is the one whose subnetwork must show.
        pruner = max(clients, key=lambda c: extra[f"param_reduction.{c}"])
        own = store.read_blob(job, final, BlobRef(CLIENT_PART, pruner))
    finally:
        store.close()
    # The same evaluation as the record's (same clients, same local test sets).
    assert personal == pytest.approx(last.personal_accuracy)
    assert personal > shared_only, (personal, shared_only)
    assert extra[f"param_reduction.{pruner}"] > 0.0
    pruned = [n for n in own if n.endswith("weight") and own[n].dim() > 1]
    assert pruned, sorted(own)
    for name in pruned:  # someone keeps each weight
        assert torch.count_nonzero(shared[name]) == shared[name].numel(), name
    # The pruner's subnetwork: its published model is zero where its mask prunes.
    assert sum(int((own[n] == 0).sum()) for n in pruned) > 0
    assert all(torch.isfinite(t).all() for t in shared.values() if t.is_floating_point())
