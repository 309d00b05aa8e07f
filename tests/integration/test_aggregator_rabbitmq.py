"""One aggregator round on a real RabbitMQ and Redis, with scripted clients and worker."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator

import pytest
import torch

from broker.store import CLIENT_PART, SERVER_PART, BlobRef
from services.aggregator.aggregator import Aggregator, ensure_initial_version
from services.algorithms.registry import build_strategy
from services.common.backends import Backends
from services.config.root import Settings
from services.report.records import ListSink, VersionRecord
from tests.unit.test_aggregator_peers import (
    WAIT_S,
    FakeClient,
    FakeWorker,
    add_member,
    client_loop,
    declare_all,
    delete_all,
    make_settings,
    running,
    worker_loop,
)

pytestmark = [pytest.mark.rabbitmq, pytest.mark.redis]

SAMPLES = {"a": 10, "b": 30}


def constant(value: float) -> Callable[[int], float]:
    return lambda round_index: value


@pytest.fixture
def settings(job: str, amqp_url: str, redis_url: str) -> Iterator[Settings]:
    settings = make_settings(
        job,
        job={"rounds": 1},
        broker={"kind": "rabbitmq", "amqp_url": amqp_url},
        store={"kind": "redis", "redis_url": redis_url},
        clients={"count": 2, "min_to_start": 2},
    )
    yield settings
    delete_all(Backends(settings.broker, settings.store), settings, list(SAMPLES))


def test_one_round_over_rabbitmq_and_redis(settings: Settings) -> None:
    job = settings.job.name
    backends = Backends(settings.broker, settings.store)
    store = backends.open_store()
    try:
        ensure_initial_version(
            store, settings, build_strategy("sfl_v2"), logging.getLogger("test.aggregator")
        )
        for i, (client, samples) in enumerate(SAMPLES.items()):
            add_member(store, job, client, samples=samples, partition=i)
        declare_all(backends, settings, list(SAMPLES))
        fakes = [FakeClient(c, n, constant(i + 1.0)) for i, (c, n) in enumerate(SAMPLES.items())]
        worker = FakeWorker(store.read_blob(job, 1, BlobRef(SERVER_PART)), constant(-2.0))
        sink = ListSink()
        aggregator = Aggregator(settings, backends, sink=sink, poll_s=0.05)
        result: list[list[VersionRecord]] = []
        done = threading.Event()

        def aggregate(stop: threading.Event) -> None:
            result.append(aggregator.run(stop))
            done.set()

        peers = [client_loop(backends, job, f) for f in fakes]
        peers.append(worker_loop(backends, job, 1, worker))
        with running([*peers, aggregate]):
            assert done.wait(WAIT_S), "the aggregator did not finish"

        assert store.versions(job)[-1] == 2 and sink.status == "finished"
        assert [(r.version, r.participants, r.samples) for r in result[0]] == [(2, 2, 20)]
        client_avg = (10 * 1.0 + 30 * 2.0) / 40
        for ref, value in ((CLIENT_PART, client_avg), (SERVER_PART, -2.0)):
            for name, tensor in store.read_blob(job, 2, BlobRef(ref)).items():
                if tensor.is_floating_point():
                    torch.testing.assert_close(tensor, torch.full_like(tensor, value), msg=name)
        assert all(not f.assignments()[-1].participate for f in fakes)
    finally:
        store.close()
