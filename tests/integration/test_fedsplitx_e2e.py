"""FedSplitX end to end: clients at depth levels 1, 2 and 3 train one model together through
real RabbitMQ and Redis, and the embedded `splitmq run` of the two examples.

The service test runs the coordinator, the aggregator, one worker and six clients (two per
level, from `clients.capability_mix`) on threads of this process, each role with its own broker
and store connections. It checks that every client trained at the level its partition
declares, in the same rounds as the others; that the worker's replica trained on activations
from all three cuts; that no batch was dead-lettered; and that the model learned: the full
model and every level's own client model (its blocks with its last head) well above chance
(10%) on the sample's 1000 test images.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner

from services.aggregator.aggregator import Aggregator
from services.aggregator.evaluation import build_evaluator
from services.cli.main import cli
from services.client.client import Client
from services.client.data import JobData
from services.client.stats import ClientStats
from services.common.backends import Backends, Embedded
from services.common.supervise import RoleSpec, Supervisor
from services.config.root import Settings
from services.coordinator.coordinator import Coordinator
from services.data.loaders import load_dataset
from services.report.records import ListSink
from tests.integration.test_exactness import Kept
from tests.unit.test_aggregator_peers import delete_all
from tests.unit.test_worker_support import one_torch_thread
from workers.stats import WorkerStats
from workers.worker import Worker

__all__ = ["one_torch_thread"]  # the autouse fixture, imported so that it applies here

pytestmark = pytest.mark.slow

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
ROUNDS = 3
CLIENTS = 6
MIX = "2,2,2"  # partitions 0-1 at level 1, 2-3 at level 2, 4-5 at level 3
RUN_LIMIT_S = 90.0  # a hung run fails here, not at pytest's timeout
# Floors on the sample's test set after three rounds of 30 steps. Three runs measured the full
# model at 0.71-0.75 and the levels' client models at 0.67-0.68 (level 1), 0.74-0.75 (2) and
# 0.72-0.76 (3); chance is 0.10. The server's batch order depends on timing, so runs differ.
FULL_MODEL_FLOOR = 0.6
CLIENT_MODEL_FLOOR = 0.55


@pytest.fixture
def settings(job: str, amqp_url: str, redis_url: str) -> Iterator[Settings]:
    settings = Settings.model_validate(
        {
            "broker": {"kind": "rabbitmq", "amqp_url": amqp_url},
            "store": {"kind": "redis", "redis_url": redis_url},
            "job": {"name": job, "seed": 0, "rounds": ROUNDS},
            "model": {"name": "cnn5", "cut": "block1"},
            "data": {"dataset": "fashion_mnist_sample", "partition": "iid"},
            "algorithm": {
                "name": "fedsplitx",
                "batch_size": 32,
                "lr": 0.05,
                "momentum": 0.9,
                "max_steps_per_round": 30,
            },
            "clients": {
                "count": CLIENTS,
                "min_to_start": CLIENTS,
                "capability_mix": MIX,
                "heartbeat_s": 0.5,
                "heartbeat_ttl_s": 60.0,
            },
            "workers": {"checkpoint_every_steps": 20},
            "report": {"plots": False},
        }
    )
    yield settings
    backends = Backends(settings.broker, settings.store, Embedded())
    delete_all(backends, settings, [f"client-{i}" for i in range(CLIENTS)])


@pytest.mark.rabbitmq
@pytest.mark.redis
def test_clients_at_three_depths_train_together_and_learn(settings: Settings) -> None:
    job = settings.job.name
    backends = Backends(settings.broker, settings.store, Embedded())
    dataset = load_dataset("fashion_mnist_sample", None)
    shared = JobData(settings, dataset)
    sink = ListSink()
    worker = Kept(Worker(settings, backends, worker_id="worker-0", poll_s=0.05))
    clients = [
        Kept(Client(settings, backends, client_id=f"client-{i}", partition=i, dataset=shared))
        for i in range(CLIENTS)
    ]
    evaluator = build_evaluator(settings, dataset.test)
    aggregator = Aggregator(settings, backends, sink=sink, poll_s=0.05, evaluator=evaluator)
    roles = [
        RoleSpec("aggregator", "aggregator", aggregator),
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
    assert sink.status == "finished"
    assert [r.version for r in sink.records] == [2, 3, 4]

    # Every round had all six clients, each at the level its partition declares.
    want = {f"client-{i}": float(1 + i // 2) for i in range(CLIENTS)}
    for record in sink.records:
        assert record.participants == CLIENTS
        assert {c: record.extra[f"level.{c}"] for c in want} == want, record.extra

    # The one replica trained on activations from every depth, and nothing was refused.
    store = backends.open_store()
    try:
        checkpoint = store.load_checkpoint(job, 0)
    finally:
        store.close()
    assert checkpoint is not None
    assert set(checkpoint.meta["cut_samples"]) == {"block1", "block2", "block3"}
    stats = worker.result
    assert isinstance(stats, WorkerStats)
    assert stats.dead_lettered_total == 0 and stats.rollbacks == 0, stats
    steps = ROUNDS * settings.algorithm.max_steps_per_round
    assert stats.batches_applied == CLIENTS * steps
    for kept in clients:
        client_stats = kept.result
        assert isinstance(client_stats, ClientStats)
        assert client_stats.finished and client_stats.rounds == ROUNDS
        assert client_stats.rounds_aborted == 0
        assert client_stats.batches_sent == steps

    # It learned: the full model and each level's client model on the test set.
    last = sink.records[-1]
    assert last.global_accuracy >= FULL_MODEL_FLOOR, last
    for level in (1, 2, 3):
        assert last.extra[f"level{level}.client_accuracy"] >= CLIENT_MODEL_FLOOR, last.extra
    # Deeper clients leave the server less to do.
    server = [last.extra[f"level{m}.server_flops"] for m in (1, 2, 3)]
    assert server == sorted(server, reverse=True) and server[0] > 10 * server[2]


@pytest.mark.parametrize(
    ("example", "extra"),
    [("fedsplitx.toml", "level3.client_accuracy"), ("local_loss_sfl.toml", "level1.client_flops")],
)
def test_examples_learn_embedded(tmp_path: Path, example: str, extra: str) -> None:
    env = {
        "SPLITMQ_CONFIG": None,
        "SPLITMQ_JOB__ROUNDS": "2",
        "SPLITMQ_REPORT__DIR": str(tmp_path / "runs"),
        "SPLITMQ_REPORT__PLOTS": "false",
    }
    result = CliRunner().invoke(cli, ["run", str(EXAMPLES / example)], env=env)
    assert result.exit_code == 0, result.output
    (run_dir,) = list((tmp_path / "runs").iterdir())
    doc = json.loads((run_dir / "metrics.json").read_text())
    assert doc["run"]["status"] == "finished"
    last = doc["records"][-1]
    assert last["version"] == 3
    assert last["global_accuracy"] >= 0.5, last  # chance: 0.1
    assert extra in last["extra"]
