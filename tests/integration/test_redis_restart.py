"""A Redis restart mid-run: the roles wait for the store, resume, and the job finishes.

The real roles (aggregator, coordinator, one worker holding both shards, three clients) run on
threads of this process over the real RabbitMQ and a private `redis-server --appendonly yes` on
a free port (never the shared Redis on 6379, which other tests use). Once round 1 is closed,
the test shuts that Redis down (SHUTDOWN flushes the AOF), keeps it down for longer than the
worker's lease TTL, starts it again on the same port and directory, and checks that every
round is published, the global model is above chance, and the logs say the store went away
and came back.
"""

from __future__ import annotations

import logging
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from broker.keys import version_key
from broker.topology import job_queues, reply_queue_name
from services.config.root import Settings
from services.data.loaders import load_dataset
from services.report.records import ListSink
from services.runtime.backends import Backends
from services.runtime.roles import embedded_roles
from services.runtime.supervise import Outcome, Supervisor
from tests.unit.test_worker_support import one_torch_thread

__all__ = ["one_torch_thread"]  # the autouse fixture, imported so that it applies here

pytestmark = [pytest.mark.rabbitmq, pytest.mark.redis, pytest.mark.slow]

ROUNDS = 4
CLIENTS = 3
SHARDS = 2
LEASE_TTL_S = 2.0
DOWN_S = 4.0  # longer than the lease TTL: the worker's leases expire while Redis is down


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class PrivateRedis:
    def __init__(self, port: int, directory: Path) -> None:
        self.port = port
        self.dir = directory
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        argv = ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1"]
        argv += ["--appendonly", "yes", "--save", "", "--dir", str(self.dir)]
        with (self.dir / "redis.log").open("ab") as log:
            self.process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
        client = redis.Redis(port=self.port, socket_connect_timeout=0.5)
        for _ in range(100):
            try:
                if client.ping():
                    return
            except redis.ConnectionError:
                time.sleep(0.05)
        pytest.fail(f"private redis-server on port {self.port} did not start")

    def shutdown(self) -> None:
        """SHUTDOWN: the server fsyncs the AOF and exits (what `docker compose restart` does)."""
        assert self.process is not None
        client = redis.Redis(port=self.port)
        try:
            client.shutdown()
        except redis.ConnectionError:
            pass  # the server closes the connection as it goes
        self.process.wait(10)

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)


@pytest.fixture
def private_redis(tmp_path: Path) -> Iterator[PrivateRedis]:
    if shutil.which("redis-server") is None:
        pytest.fail("redis-server is not installed")
    server = PrivateRedis(free_port(), tmp_path)
    server.start()
    yield server
    server.kill()


def job_settings(job: str, amqp_url: str, redis_url: str) -> Settings:
    return Settings.model_validate(
        {
            "broker": {"kind": "rabbitmq", "amqp_url": amqp_url},
            "store": {
                "kind": "redis",
                "redis_url": redis_url,
                "retry_for_s": 60.0,
                "retry_max_backoff_s": 0.5,
            },
            "job": {"name": job, "rounds": ROUNDS, "seed": 0},
            "model": {"name": "cnn5", "cut": "block1"},
            "data": {"dataset": "fashion_mnist_sample", "eval_samples": 500},
            "algorithm": {
                "name": "sfl",
                "shards": SHARDS,
                "batch_size": 32,
                "lr": 0.05,
                "momentum": 0.9,
                "max_steps_per_round": 12,
            },
            "clients": {"count": CLIENTS, "min_to_start": CLIENTS, "heartbeat_ttl_s": 30.0},
            "rounds": {"deadline_s": 60.0},
            "workers": {
                "count": 1,
                "lease_ttl_s": LEASE_TTL_S,
                "checkpoint_every_steps": 3,
                "device": "cpu",
            },
            "report": {"plots": False},
        }
    )


def delete_queues(settings: Settings) -> None:
    broker = Backends(settings.broker, settings.store).open_broker("cleanup", give_up_after=10.0)
    try:
        names = [q.name for q in job_queues(settings.job.name, settings.shards)]
        names += [reply_queue_name(settings.job.name, f"client-{i}") for i in range(CLIENTS)]
        for name in names:
            broker.delete_queue(name)
    finally:
        broker.close()


def test_roles_wait_out_a_redis_restart_and_finish_the_job(
    amqp_url: str,
    private_redis: PrivateRedis,
    job: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    settings = job_settings(job, amqp_url, private_redis.url)
    backends = Backends(settings.broker, settings.store)
    sink = ListSink()
    roles = embedded_roles(settings, backends, sink, load_dataset("fashion_mnist_sample"))
    stop = threading.Event()
    outcome: list[Outcome] = []
    runner = threading.Thread(
        target=lambda: outcome.append(
            Supervisor(roles, stop, client_grace_s=20.0, join_timeout_s=30.0).run()
        ),
        name="supervisor",
    )
    watcher = redis.Redis(port=private_redis.port)
    caplog.set_level(logging.INFO)
    try:
        runner.start()
        give_up = time.monotonic() + 60
        # Round 1 closed (version 2 published): the run is under way on every role.
        while int(watcher.get(version_key(job)) or 0) < 2:
            assert runner.is_alive(), outcome
            assert time.monotonic() < give_up, "round 1 did not close within 60 s"
            time.sleep(0.1)
        version_before = int(watcher.get(version_key(job)) or 0)
        private_redis.shutdown()
        time.sleep(DOWN_S)
        private_redis.start()
        # The AOF brought every committed version back.
        assert int(watcher.get(version_key(job)) or 0) >= version_before
        runner.join(90)
        assert not runner.is_alive(), "the job did not finish within 90 s of the restart"
    finally:
        stop.set()
        runner.join(30)
        delete_queues(settings)

    assert outcome and outcome[0].ok, outcome
    assert len(sink.records) >= ROUNDS
    last = sink.records[-1]
    assert last.global_accuracy > 0.2, last  # 10 classes: chance is 0.1
    messages = [r.getMessage() for r in caplog.records]
    assert any("waiting for Redis" in m for m in messages), "no role said it waited for Redis"
    back = [m for m in messages if m.startswith("store back after")]
    assert back, "no role said the store came back"
    # Down for DOWN_S, measured from each role's first failed call.
    assert all(0 < float(m.split()[3]) < DOWN_S + 30 for m in back), back
