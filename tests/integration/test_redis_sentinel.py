"""The Redis store behind Sentinel: a failover, a demoted primary, replicas that do not answer.

Each test starts its own primary, replicas and three Sentinels (`sentinel_cluster`, ports
6493-6495 and 26493-26495; SIGKILLed at teardown) and drives one `RedisWeightStore` through
what a real failover does to it. What is checked is what a role relies on: no error reaches
the caller while Sentinel promotes a replica, and with `min_replicas = 1` every version and
checkpoint the store acknowledged is still there, byte for byte, on the promoted replica.
"""

from __future__ import annotations

import itertools
import logging
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import torch

from broker import keys
from broker.errors import StoreUnavailableError
from broker.redis_store import RedisStoreOptions, RedisWeightStore, RetryPolicy
from broker.store import BlobRef, Checkpoint, Weights
from broker.store_codec import prepare_blobs
from services.common.backends import Backends
from services.config.settings import BrokerSettings, StoreSettings
from services.runtime.doctor import check_store
from tests.integration.sentinel_cluster import (
    HOST,
    MASTER,
    SentinelCluster,
    require_redis_server,
    wait_for,
)

pytestmark = [pytest.mark.redis]

DATA_PORTS = [6493, 6494, 6495]
SENTINEL_PORTS = [26493, 26494, 26495]
SERVER = BlobRef("server")
CLIENT = BlobRef("client")


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[SentinelCluster]:
    require_redis_server()
    c = SentinelCluster(tmp_path, DATA_PORTS, SENTINEL_PORTS)
    try:
        c.start()
        yield c
    finally:
        c.stop()


def sentinel_store(
    cluster: SentinelCluster,
    *,
    min_replicas: int = 1,
    retry_for_s: float = 60.0,
    replica_timeout_s: float = 2.0,
    logger: logging.Logger | None = None,
) -> RedisWeightStore:
    addresses = tuple((HOST, port) for port in cluster.sentinel_ports)
    options = RedisStoreOptions(
        socket_timeout_s=5.0,
        socket_connect_timeout_s=1.0,
        keep_versions=1000,
        retry=RetryPolicy(retry_for_s=retry_for_s, first_backoff_s=0.05, max_backoff_s=0.5),
        sentinels=addresses,
        master_name=MASTER,
        min_replicas=min_replicas,
        replica_timeout_s=replica_timeout_s,
    )
    return RedisWeightStore(cluster.url, options, logger=logger)


def weights(seed: int) -> dict[BlobRef, Weights]:
    g = torch.Generator().manual_seed(seed)
    return {
        SERVER: {"fc.weight": torch.randn(64, 32, generator=g)},
        CLIENT: {"conv.weight": torch.randn(8, 3, 3, 3, generator=g)},
    }


def checkpoint(applied: int) -> Checkpoint:
    return Checkpoint(0, applied, {"w": torch.full((16,), float(applied))}, {"steps": applied})


def assert_version_holds(store: RedisWeightStore, job: str, version: int, seed: int) -> None:
    for ref, expected in weights(seed).items():
        got = store.read_blob(job, version, ref)
        assert set(got) == set(expected), (version, ref)
        assert all(torch.equal(got[n], t) for n, t in expected.items()), (version, ref)


class Writer:
    """Publishes a version and saves a checkpoint in turn, as fast as the store lets it,
    recording what the store acknowledged and when."""

    def __init__(self, store: RedisWeightStore, job: str) -> None:
        self.store, self.job = store, job
        self.acked: list[tuple[int, int, float]] = []  # (version, seed, when acknowledged)
        self.checkpoint_acked = 0
        self.errors: list[BaseException] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="writer")

    def _run(self) -> None:
        version = 0
        try:
            while not self.stop.is_set():
                seed = version + 1
                version = self.store.publish_version(self.job, version, weights(seed))
                self.acked.append((version, seed, time.monotonic()))
                self.store.save_checkpoint(self.job, checkpoint(version))
                self.checkpoint_acked = version
        except BaseException as exc:  # handed to the test, which fails on it
            self.errors.append(exc)

    def wait_acked(self, count: int, timeout_s: float = 60.0) -> None:
        done = lambda: len(self.acked) >= count or bool(self.errors)  # noqa: E731
        wait_for(f"{count} versions acknowledged", done, timeout_s)
        assert not self.errors, self.errors


def test_a_failover_is_ridden_out_and_loses_no_acknowledged_write(
    cluster: SentinelCluster, job: str, caplog: pytest.LogCaptureFixture
) -> None:
    log = logging.getLogger("test.sentinel.failover")
    store = sentinel_store(cluster, logger=log)
    writer = Writer(store, job)
    old_primary = cluster.primary_port()
    try:
        with caplog.at_level(logging.INFO, logger=log.name):
            writer.thread.start()
            writer.wait_acked(5)
            killed_at = time.monotonic()
            cluster.sigkill(old_primary)
            acked_at_kill = len(writer.acked)
            writer.wait_acked(acked_at_kill + 5)
        writer.stop.set()
        writer.thread.join(30)
        assert not writer.errors, writer.errors
        new_primary = cluster.primary_port()
        assert new_primary != old_primary
        # The longest gap between two acknowledged versions spans the failover.
        times = [killed_at] + [t for _, _, t in writer.acked if t > killed_at]
        stall = max(b - a for a, b in itertools.pairwise(times))
        print(f"failover: publishes stalled {stall:.2f} s after the primary was killed")
        # Every acknowledged version and the last acknowledged checkpoint are on the new
        # primary, unchanged: min_replicas = 1 had them on a replica before the ack.
        assert store.current_version(job) == writer.acked[-1][0]
        assert store.versions(job) == [v for v, _, _ in writer.acked]
        for version, seed, _ in writer.acked:
            assert_version_holds(store, job, version, seed)
        saved = store.load_checkpoint(job, 0)
        assert saved is not None and saved.applied >= writer.checkpoint_acked
        assert store.publish_version(job, writer.acked[-1][0], weights(0)) == len(writer.acked) + 1
        messages = [r.getMessage() for r in caplog.records]
        assert len([m for m in messages if "waiting for Redis" in m]) == 1, messages
        assert len([m for m in messages if m.startswith("store back after")]) == 1, messages
    finally:
        writer.stop.set()
        writer.thread.join(30)
        store.close()


def demote_by_hand(cluster: SentinelCluster, old: int, new: int) -> None:
    """What happens when the old primary comes back as a replica while a client still holds
    a connection to it: REPLICAOF keeps its clients connected, so their next write is
    answered READONLY. The sentinels are pointed at the new primary."""
    cluster.client(new).replicaof("NO", "ONE")
    for port in cluster.data_ports:
        if port != new:
            cluster.client(port).replicaof(HOST, new)
    for port in cluster.data_ports:
        if port != new:
            cluster.wait_replica_linked(port)
    for port in cluster.sentinel_ports:
        sentinel = cluster.client(port)
        sentinel.sentinel_remove(MASTER)
        sentinel.sentinel_monitor(MASTER, HOST, new, 2)
    assert cluster.primary_port() == new


def readonly_replies(cluster: SentinelCluster, port: int) -> int:
    stats: Any = cluster.client(port).info("errorstats")
    return int(stats.get("errorstat_READONLY", {}).get("count", 0))


def test_a_demoted_primary_answering_readonly_is_ridden_out(
    cluster: SentinelCluster, job: str
) -> None:
    store = sentinel_store(cluster)
    try:
        old, new = DATA_PORTS[0], DATA_PORTS[1]
        assert store.publish_version(job, 0, weights(1)) == 1  # a pooled connection to `old`
        store.save_checkpoint(job, checkpoint(1))
        demote_by_hand(cluster, old, new)
        before = readonly_replies(cluster, old)
        assert store.publish_version(job, 1, weights(2)) == 2
        store.save_checkpoint(job, checkpoint(2))
        assert readonly_replies(cluster, old) > before, "the store never met the READONLY"
        assert int(cluster.client(new).get(keys.version_key(job)) or 0) == 2
        assert_version_holds(store, job, 1, 1)
        assert_version_holds(store, job, 2, 2)
        saved = store.load_checkpoint(job, 0)
        assert saved is not None and saved.applied == 2
    finally:
        store.close()


def test_replicas_that_do_not_acknowledge_make_the_store_unavailable(
    cluster: SentinelCluster, job: str
) -> None:
    # Both replicas gone: WAIT 1 cannot be satisfied.
    short = sentinel_store(cluster, retry_for_s=1.5, replica_timeout_s=0.3)
    try:
        assert short.publish_version(job, 0, weights(1)) == 1
        for port in DATA_PORTS[1:]:
            cluster.sigkill(port)
        with pytest.raises(StoreUnavailableError, match=r"not replicated.*min_replicas = 1"):
            short.publish_version(job, 1, weights(2))
        # Committed on the primary, never acknowledged: visible, as documented.
        assert short.current_version(job) == 2
        with pytest.raises(StoreUnavailableError, match=r"checkpoint of shard 0.*0 of"):
            short.save_checkpoint(job, checkpoint(2))
        # A replica that comes back within retry_for_s: the publish waits for it and succeeds.
        patient = sentinel_store(cluster, retry_for_s=60.0, replica_timeout_s=0.3)
        try:
            restart = threading.Timer(1.0, lambda: cluster.start_node(DATA_PORTS[1], DATA_PORTS[0]))
            restart.start()
            started = time.monotonic()
            assert patient.publish_version(job, 2, weights(3)) == 3
            assert time.monotonic() - started >= 1.0
            restart.join()
            replica = cluster.client(DATA_PORTS[1])
            assert int(replica.get(keys.version_key(job)) or 0) == 3
        finally:
            patient.close()
    finally:
        short.close()


def test_with_min_replicas_0_no_wait_is_sent(cluster: SentinelCluster, job: str) -> None:
    store = sentinel_store(cluster, min_replicas=0)
    primary = cluster.client(cluster.primary_port())
    try:
        before = primary.info("commandstats").get("cmdstat_wait", {}).get("calls", 0)
        store.publish_version(job, 0, weights(1))
        store.save_checkpoint(job, checkpoint(1))
        assert primary.info("commandstats").get("cmdstat_wait", {}).get("calls", 0) == before
        waiting = sentinel_store(cluster, min_replicas=2)
        try:
            waiting.publish_version(job, 1, weights(2))
            waiting.save_checkpoint(job, checkpoint(2))
        finally:
            waiting.close()
        after = primary.info("commandstats")["cmdstat_wait"]["calls"]
        assert after == before + 2
    finally:
        store.close()


def test_doctor_reports_sentinels_primary_and_replicas(cluster: SentinelCluster) -> None:
    settings = StoreSettings(
        kind="redis",
        redis_url=cluster.url,
        sentinels=tuple(cluster.sentinels),
        master_name=MASTER,
        min_replicas=1,
    )
    check = check_store(Backends(BrokerSettings(), settings))
    assert check.ok and not check.warning, check
    assert f"primary {HOST}:{DATA_PORTS[0]}" in check.detail, check.detail
    for port in DATA_PORTS[1:]:
        assert f"{HOST}:{port} (online" in check.detail, check.detail
    for port in SENTINEL_PORTS:
        assert f"{HOST}:{port} ok (primary {HOST}:{DATA_PORTS[0]}" in check.detail
    # min_replicas above what is online is a problem the doctor names.
    too_many = settings.model_copy(update={"min_replicas": 3})
    check = check_store(Backends(BrokerSettings(), too_many))
    assert check.warning and "store.min_replicas = 3" in check.hint, check


def test_a_blob_lost_before_the_commit_is_written_again(redis_url: str, job: str) -> None:
    """What a failover between the blob writes and the commit looks like to the store: a
    blob it wrote is gone when the commit runs (the promoted replica never got it)."""

    class LosesBlobAfterWriting(RedisWeightStore):
        lost = 0

        def _write_pending(self, job: str, blobs: Any) -> list[str]:
            created: list[str] = super()._write_pending(job, blobs)
            if not type(self).lost:
                type(self).lost = self._db.client.delete(created[0])
            return created

    store = LosesBlobAfterWriting(redis_url)
    try:
        assert store.publish_version(job, 0, weights(1)) == 1
        assert LosesBlobAfterWriting.lost == 1
        assert_version_holds(store, job, 1, 1)
        raw = redis.Redis.from_url(redis_url)
        try:
            found = list(raw.scan_iter(match=keys.job_prefix(job) + "w:*"))
            assert len(found) == 2, found
            for key in found:
                assert raw.pttl(key) == -1, "a committed blob kept its pending expiry"
        finally:
            raw.close()
    finally:
        store.delete_job(job)
        store.close()


def test_a_retried_commit_waits_for_the_replicas_to_reach_the_original_commit(
    cluster: SentinelCluster, job: str
) -> None:
    """The first try committed and WAIT came back short; the retry travels on a fresh
    connection. Replicas stopped by SIGSTOP stay connected with their acknowledged offset
    frozen: the retry must block until they run again, not report an unreplicated version
    as acknowledged. (Redis documents WAIT as covering its own connection's writes, hence
    the retry's rewrite of the commit id; Redis 7.0 here also blocks a fresh connection's
    WAIT until the replicas reach the current offset, so this guards the behaviour, not
    that rewrite.)"""
    first = sentinel_store(cluster, retry_for_s=0.0, replica_timeout_s=0.2)
    retry = sentinel_store(cluster, retry_for_s=30.0, replica_timeout_s=0.2)
    stopped = [cluster.processes[port] for port in DATA_PORTS[1:]]
    try:
        assert first.publish_version(job, 0, weights(1)) == 1
        for process in stopped:
            process.send_signal(signal.SIGSTOP)
        with pytest.raises(StoreUnavailableError, match="not replicated"):
            first.publish_version(job, 1, weights(2))
        manifest = keys.manifest_key(job, 2)
        commit_id = cluster.client(DATA_PORTS[0]).hget(manifest, "commit_id")
        assert isinstance(commit_id, bytes)
        blobs = prepare_blobs(job, 2, weights(2), None)
        resume = threading.Timer(1.0, lambda: [p.send_signal(signal.SIGCONT) for p in stopped])
        resume.start()
        started = time.monotonic()
        assert retry._commit(job, 1, blobs, commit_id.decode(), {})[0] == "ok"
        waited = time.monotonic() - started
        resume.join()
        assert waited >= 1.0, f"acknowledged after {waited:.2f} s, with the replicas stopped"
        for port in DATA_PORTS[1:]:
            assert int(cluster.client(port).get(keys.version_key(job)) or 0) == 2
    finally:
        for process in stopped:
            process.send_signal(signal.SIGCONT)
        first.close()
        retry.close()
