"""A Redis restart mid-run: the roles wait for the store, resume, and the job finishes.

The real roles (aggregator, coordinator, one worker holding both shards, three clients) run on
threads of this process over the real RabbitMQ and a private `redis-server --appendonly yes
--appendfsync always` (as compose runs it) on a free port (never the shared Redis on 6379,
which other tests use). Once version 2 is published, the test takes that Redis away for longer than
the worker's lease TTL, starts it again on the same port and directory, and checks that every
round is published, the global model is above chance, and the logs say the store went away
and came back. Two ways to go:

- SHUTDOWN (what `docker compose restart redis` does): the server flushes the AOF and exits;
- SIGKILL half a second after version 2 is published, while the worker applies the next
  round's batches, checkpoints and acks them: nothing is flushed on the way out. A watcher
  reads every version as it appears (manifest and blobs). After the restart the current
  version must be at least the newest one it saw, every version it saw must still hold the
  same blobs (a lost version republished under its number would not), and at the end every
  batch a client sent must be applied exactly once (the shards' checkpoint audit): no
  checkpoint the worker acked batches on may have been lost.
"""

from __future__ import annotations

import logging
import shutil
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import redis

from broker.errors import StoreUnavailableError, VersionNotFoundError
from broker.keys import version_key
from broker.redis_store import RedisStoreOptions, RedisWeightStore
from broker.store import BlobRef
from broker.topology import job_queues, reply_queue_name
from services.client.stats import ClientStats
from services.common.backends import Backends
from services.common.supervise import Outcome, Role, Supervisor
from services.config.root import Settings
from services.data.loaders import load_dataset
from services.report.records import ListSink, VersionRecord
from services.runtime.roles import embedded_roles
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
    def __init__(self, port: int, directory: Path, fsync: str = "always") -> None:
        self.port = port
        self.dir = directory
        self.fsync = fsync  # appendfsync, as compose/docker-compose.yml sets it
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        argv = ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1"]
        argv += ["--appendonly", "yes", "--appendfsync", self.fsync]
        argv += ["--save", "", "--dir", str(self.dir)]
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

    def sigkill(self) -> None:
        """A crash: SIGKILL, so nothing is flushed on the way out."""
        assert self.process is not None
        self.process.send_signal(signal.SIGKILL)
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


class VersionWatch:
    """Reads every version of the job as it appears, as a dashboard or a resuming role would:
    its manifest, and each blob (checked against the manifest's sha256). Store errors (the
    outage) are retried on the next poll."""

    def __init__(self, url: str, job: str) -> None:
        options = RedisStoreOptions(retries=0, socket_timeout_s=2.0, socket_connect_timeout_s=0.5)
        self._store = RedisWeightStore(url, options)
        self._job = job
        self._lock = threading.Lock()
        self._seen: dict[int, dict[BlobRef, str]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="version-watch", daemon=True)

    def __enter__(self) -> VersionWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)
        self._store.close()

    def seen(self) -> dict[int, dict[BlobRef, str]]:
        with self._lock:
            return dict(self._seen)

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            try:
                current = self._store.current_version(self._job)
                for version in range(max(self._seen, default=0) + 1, current + 1):
                    self._read(version)
            except (StoreUnavailableError, VersionNotFoundError):
                continue  # Redis is down; or retention took a version before we looked

    def _read(self, version: int) -> None:
        manifest = self._store.manifest(self._job, version)
        for ref in manifest.entries:
            self._store.read_blob(self._job, version, ref)  # raises if torn or corrupt
        with self._lock:
            self._seen[version] = {ref: e.sha256 for ref, e in manifest.entries.items()}


class Recorded:
    """A role whose `run` result (a client's stats) the test reads afterwards."""

    def __init__(self, inner: Role) -> None:
        self.inner = inner
        self.result: object = None

    def run(self, stop: threading.Event) -> object:
        self.result = self.inner.run(stop)
        return self.result


def run_through_outage(
    settings: Settings,
    private_redis: PrivateRedis,
    outage: Callable[[], None],
    restarted: Callable[[], None],
    caplog: pytest.LogCaptureFixture,
) -> tuple[list[VersionRecord], dict[str, ClientStats]]:
    """Run the job; once round 1 is closed call `outage()` (which takes Redis away), keep it
    down for DOWN_S, start it again, call `restarted()` at once, and wait for the job to
    finish. Checks that the job finished and that the roles logged the outage; returns the
    records and each client's stats by client id."""
    backends = Backends(settings.broker, settings.store)
    sink = ListSink()
    roles = [
        replace(spec, role=Recorded(spec.role)) if spec.kind == "client" else spec
        for spec in embedded_roles(settings, backends, sink, load_dataset("fashion_mnist_sample"))
    ]
    stop = threading.Event()
    outcome: list[Outcome] = []
    runner = threading.Thread(
        target=lambda: outcome.append(
            Supervisor(roles, stop, client_grace_s=20.0, join_timeout_s=30.0).run()
        ),
        name="supervisor",
    )
    job = settings.job.name
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
        outage()
        time.sleep(DOWN_S)
        private_redis.start()
        restarted()
        runner.join(90)
        assert not runner.is_alive(), "the job did not finish within 90 s of the restart"
    finally:
        stop.set()
        runner.join(30)
        delete_queues(settings)

    assert outcome and outcome[0].ok, outcome
    messages = [r.getMessage() for r in caplog.records]
    assert any("waiting for Redis" in m for m in messages), "no role said it waited for Redis"
    back = [m for m in messages if m.startswith("store back after")]
    assert back, "no role said the store came back"
    # Down for DOWN_S, measured from each role's first failed call.
    assert all(0 < float(m.split()[3]) < DOWN_S + 30 for m in back), back
    stats = {s.name: s.role.result for s in roles if isinstance(s.role, Recorded)}
    assert all(isinstance(s, ClientStats) for s in stats.values()), stats
    return list(sink.records), {n: s for n, s in stats.items() if isinstance(s, ClientStats)}


def test_roles_wait_out_a_redis_restart_and_finish_the_job(
    amqp_url: str,
    private_redis: PrivateRedis,
    job: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    settings = job_settings(job, amqp_url, private_redis.url)
    watcher = redis.Redis(port=private_redis.port)
    before: list[int] = []

    def shutdown() -> None:
        before.append(int(watcher.get(version_key(job)) or 0))
        private_redis.shutdown()

    def restarted() -> None:
        # The AOF brought every committed version back.
        assert int(watcher.get(version_key(job)) or 0) >= before[0]

    records, _ = run_through_outage(settings, private_redis, shutdown, restarted, caplog)
    assert len(records) >= ROUNDS
    last = records[-1]
    assert last.global_accuracy > 0.2, last  # 10 classes: chance is 0.1


def test_a_sigkilled_redis_loses_no_version_seen_and_no_batch_acked(
    amqp_url: str,
    private_redis: PrivateRedis,
    job: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    settings = job_settings(job, amqp_url, private_redis.url)
    raw = RedisWeightStore(private_redis.url)
    seen_before: dict[int, dict[BlobRef, str]] = {}

    def crash() -> None:
        # Into the round on version 2: the worker applies batches, checkpoints and acks them.
        time.sleep(0.5)
        seen_before.update(watch.seen())
        private_redis.sigkill()

    def restarted() -> None:
        # Before any role writes again: nothing a reader saw went missing in the crash.
        assert raw.current_version(job) >= max(seen_before, default=1)

    try:
        with VersionWatch(private_redis.url, job) as watch:
            records, stats = run_through_outage(settings, private_redis, crash, restarted, caplog)
            seen_after = watch.seen()
        assert seen_before, "the watcher saw no version before the kill"
        # Not torn, not lost, not reused: every version seen before the kill (and after) is
        # still there with the same blobs, readable; the current one is at least the newest.
        current = raw.current_version(job)
        assert current >= max(seen_before) and current >= max(seen_after)
        retained = set(raw.versions(job))
        for version, blobs in {**seen_before, **seen_after}.items():
            if version in retained:
                manifest = raw.manifest(job, version)
                assert {r: e.sha256 for r, e in manifest.entries.items()} == blobs, version
        for ref in raw.manifest(job, current).entries:
            raw.read_blob(job, current, ref)
        # Exactly once across the crash: each client's batches, all applied, none twice.
        applied: dict[str, int] = {}
        for shard in range(settings.shards):
            checkpoint = raw.load_checkpoint(job, shard)
            assert checkpoint is not None, shard
            for client, (count, _) in checkpoint.meta.get("audit", {}).items():
                applied[client] = applied.get(client, 0) + int(count)
        sent = {client: s.batches_sent for client, s in stats.items()}
        assert applied == sent and all(sent.values()), (applied, sent)
    finally:
        raw.close()
    assert len(records) >= ROUNDS
    assert records[-1].global_accuracy > 0.2, records[-1]


def test_doctor_warns_about_a_redis_without_fsync_always(private_redis: PrivateRedis) -> None:
    store = RedisWeightStore(private_redis.url)
    try:
        info = store.server_info()
        assert info.aof_enabled and info.aof_fsync == "always" and not info.problems
        redis.Redis(port=private_redis.port).config_set("appendfsync", "everysec")
        info = store.server_info()
        assert info.aof_fsync == "everysec"
        assert [p for p in info.problems if p.startswith("appendfsync everysec: ")], info
    finally:
        store.close()
