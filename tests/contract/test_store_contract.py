"""The store contract, run against the in-memory store, the Redis store on one server, and the
Redis store behind Sentinel (a primary, one replica, three sentinels started for the session,
with `min_replicas = 1` so every commit and checkpoint also WAITs): one section for each of
the protocols of `broker.store` (`VersionStore`, `CheckpointStore`, `MemberStore`,
`ScheduleStore`), then what
the union `WeightStore` adds (`delete_job`).

Expiry is exercised with a fake clock for the in-memory store and with short real TTLs (about a
second) for Redis. Crashes are injected by subclassing the store's publish steps, which is where
a real crash would interrupt it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import redis
import torch
from redis.sentinel import Sentinel

from broker import keys
from broker.errors import (
    DecodeError,
    EncodeError,
    LeaseNotHeldError,
    StoreError,
    StoreUnavailableError,
    VersionConflictError,
    VersionNotFoundError,
)
from broker.memory_store import InMemoryWeightStore
from broker.redis_store import RedisStoreOptions, RedisWeightStore
from broker.store import NO_VERSION, BlobRef, Checkpoint, JobStatus, MemberKind, WeightStore
from broker.weights import sha256_hex
from tests.integration.sentinel_cluster import MASTER, SentinelCluster, require_redis_server

REPO_ROOT = Path(__file__).resolve().parents[2]
SERVER = BlobRef("server")
CLIENT = BlobRef("client")
AUX_C1 = BlobRef("aux", "c1")


class FakeClock:
    def __init__(self) -> None:
        self.now = 1_700_000_000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@dataclass
class Harness:
    """How the suite drives one implementation."""

    kind: str
    new_store: Callable[..., Any]  # new_store(cls=None, keep_versions=5, pending_ttl_s=600.0)
    base_cls: type
    wait: Callable[[float], None]  # let `seconds` pass for expiry purposes
    corrupt: Callable[[Any, str, str], None]  # corrupt(store, job, blob_key) behind its back
    raw_blob: Callable[[Any, str, str], bytes]  # raw_blob(store, job, blob_key): stored bytes
    now: Callable[[], float]  # the store's notion of "now"
    stores: list[Any] = field(default_factory=list)


def _memory_harness() -> Harness:
    clock = FakeClock()

    def new_store(cls: type | None = None, **opts: Any) -> InMemoryWeightStore:
        store: InMemoryWeightStore = (cls or InMemoryWeightStore)(clock=clock, **opts)
        return store

    def corrupt(store: InMemoryWeightStore, job: str, key: str) -> None:
        blob = store._jobs[job].blobs[key]
        data = bytearray(blob.data)
        data[-1] ^= 0xFF
        blob.data = bytes(data)

    def raw_blob(store: InMemoryWeightStore, job: str, key: str) -> bytes:
        return store._jobs[job].blobs[key].data

    return Harness(
        "memory", new_store, InMemoryWeightStore, clock.advance, corrupt, raw_blob, clock
    )


def _redis_harness(url: str, cluster: SentinelCluster | None = None) -> Harness:
    via: dict[str, Any] = {}
    if cluster is None:
        raw = redis.Redis.from_url(url)
    else:
        addresses = tuple((h, int(p)) for h, p in (a.split(":") for a in cluster.sentinels))
        via = {"sentinels": addresses, "master_name": MASTER, "min_replicas": 1}
        raw = Sentinel(list(addresses)).master_for(MASTER)  # type: ignore[no-untyped-call]

    def new_store(cls: type | None = None, **opts: Any) -> RedisWeightStore:
        options = RedisStoreOptions(**via, **opts)
        store: RedisWeightStore = (cls or RedisWeightStore)(url, options)
        return store

    def corrupt(store: RedisWeightStore, job: str, key: str) -> None:
        data = raw.get(key)
        assert isinstance(data, bytes)
        # Flip the last byte (tensor data, not the header) and keep the key's TTL state.
        raw.setrange(key, len(data) - 1, bytes([data[-1] ^ 0xFF]))

    def raw_blob(store: RedisWeightStore, job: str, key: str) -> bytes:
        data = raw.get(key)
        assert isinstance(data, bytes)
        return data

    def now() -> float:
        seconds, micros = raw.time()
        return seconds + micros / 1e6

    harness = Harness("redis", new_store, RedisWeightStore, time.sleep, corrupt, raw_blob, now)
    harness.stores.append(raw)  # closed at teardown like the stores
    return harness


@pytest.fixture(scope="session")
def sentinel_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SentinelCluster]:
    """Primary 6490, replica 6491, sentinels 26490-26492 (the failover tests use others)."""
    require_redis_server()
    cluster = SentinelCluster(
        tmp_path_factory.mktemp("sentinel"), [6490, 6491], [26490, 26491, 26492]
    )
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(
    params=[
        "memory",
        pytest.param("redis", marks=pytest.mark.redis),
        pytest.param("redis-sentinel", marks=pytest.mark.redis),
    ]
)
def harness(request: pytest.FixtureRequest, job: str) -> Iterator[Harness]:
    if request.param == "memory":
        h = _memory_harness()
    elif request.param == "redis":
        h = _redis_harness(request.getfixturevalue("redis_url"))
    else:
        cluster = request.getfixturevalue("sentinel_cluster")
        h = _redis_harness(cluster.url, cluster)
    original = h.new_store

    def tracked(cls: type | None = None, **opts: Any) -> Any:
        store = original(cls, **opts)
        h.stores.append(store)
        return store

    h.new_store = tracked
    yield h
    for store in h.stores:
        if isinstance(store, (InMemoryWeightStore, RedisWeightStore)):
            store.delete_job(job)
            store.delete_job(job + "x")
        store.close()


@pytest.fixture
def store(harness: Harness) -> WeightStore:
    s: WeightStore = harness.new_store()
    return s


def _weights(seed: int) -> dict[BlobRef, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return {
        SERVER: {
            "fc.weight": torch.randn(16, 8, generator=g),
            "fc.bias": torch.randn(16, generator=g),
            "bn.num_batches_tracked": torch.tensor(seed, dtype=torch.int64),
        },
        CLIENT: {"conv.weight": torch.randn(4, 3, 3, 3, generator=g).to(torch.bfloat16)},
        AUX_C1: {"head.weight": torch.randn(10, 4, generator=g)},
    }


def _assert_same(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert set(actual) == set(expected)
    for name, tensor in expected.items():
        assert actual[name].dtype == tensor.dtype, name
        assert actual[name].shape == tensor.shape, name
        assert torch.equal(actual[name], tensor), name


def _blob_keys(store: Any, job: str) -> dict[str, float | None]:
    """Every blob key of the job -> seconds until it expires (None: committed), read behind
    the store's back."""
    if isinstance(store, InMemoryWeightStore):
        with store._job(job) as state:
            now = store._clock()
            blobs = state.blobs  # swept of expired blobs
            return {
                k: None if b.expires_at is None else b.expires_at - now for k, b in blobs.items()
            }
    raw = store._db.client
    found = [k.decode() for k in raw.scan_iter(match=keys.job_prefix(job) + "w:*", count=500)]
    ttls = [raw.pttl(k) for k in found]  # -1: no expiry, -2: gone since the scan
    return {k: None if t == -1 else t / 1000 for k, t in zip(found, ttls, strict=True) if t != -2}


def lease_owner(store: Any, job: str, name: str) -> str | None:
    """Who holds lease `name`, read behind the store's back (no product code needs to ask)."""
    if isinstance(store, InMemoryWeightStore):
        with store._job(job) as state:
            lease = state.leases.get(name)  # swept of expired leases
        return None if lease is None else str(lease.owner)
    raw = store._db.client.get(keys.lease_key(job, name))
    return None if raw is None else str(raw.decode())


def _referenced_keys(store: Any, job: str) -> set[str]:
    """Blob keys named by the retained manifests (recomputed from the public manifest)."""
    found = set()
    for version in store.versions(job):
        for ref, entry in store.manifest(job, version).entries.items():
            found.add(keys.blob_key(job, ref, version, entry.sha256))
    return found


def _assert_no_unreferenced_permanent_blob(store: Any, job: str) -> None:
    referenced = _referenced_keys(store, job)
    present = _blob_keys(store, job)
    assert referenced <= set(present), "a manifest names a missing blob"
    for key, ttl in present.items():
        if key not in referenced:
            assert ttl is not None and ttl > 0, f"orphan {key} never expires"


# --- VersionStore: versions -----------------------------------------------------------------------


def test_empty_job_has_no_version(store: Any, job: str) -> None:
    assert store.current_version(job) == NO_VERSION
    assert store.versions(job) == []
    with pytest.raises(VersionNotFoundError):
        store.manifest(job, 1)
    with pytest.raises(VersionNotFoundError):
        store.read_blob(job, 1, SERVER)


def test_publish_read_round_trip(harness: Harness, store: Any, job: str) -> None:
    blobs = _weights(1)
    before = harness.now()
    version = store.publish_version(
        job, NO_VERSION, blobs, samples={SERVER: 120, AUX_C1: 7}, meta={"round": "1"}
    )
    assert version == 1
    assert store.current_version(job) == 1
    assert store.versions(job) == [1]
    for ref, weights in blobs.items():
        _assert_same(store.read_blob(job, 1, ref), weights)

    manifest = store.manifest(job, 1)
    assert manifest.version == 1
    assert set(manifest.entries) == set(blobs)
    assert manifest.meta == {"round": "1"}
    assert before <= manifest.created_at <= harness.now()
    assert {ref: e.samples for ref, e in manifest.entries.items()} == {
        SERVER: 120,
        CLIENT: 0,
        AUX_C1: 7,
    }
    present = _blob_keys(store, job)
    for ref, entry in manifest.entries.items():
        assert entry.ref == ref
        key = keys.blob_key(job, ref, 1, entry.sha256)
        assert present[key] is None, "committed blobs must not expire"
        data = harness.raw_blob(store, job, key)
        assert (sha256_hex(data), len(data)) == (entry.sha256, entry.nbytes)
    assert len(present) == len(blobs)


def test_blob_not_in_version_is_an_error(store: Any, job: str) -> None:
    store.publish_version(job, NO_VERSION, {SERVER: _weights(1)[SERVER]})
    with pytest.raises(StoreError) as info:
        store.read_blob(job, 1, CLIENT)
    assert not isinstance(info.value, VersionNotFoundError)


def test_stale_expected_version_conflicts(store: Any, job: str) -> None:
    store.publish_version(job, NO_VERSION, _weights(1))
    with pytest.raises(VersionConflictError) as info:
        store.publish_version(job, NO_VERSION, _weights(2))
    assert (info.value.expected, info.value.actual) == (NO_VERSION, 1)
    assert store.current_version(job) == 1
    _assert_same(store.read_blob(job, 1, SERVER), _weights(1)[SERVER])
    # The loser's blobs are discarded at once (only version 1's blobs remain).
    assert set(_blob_keys(store, job)) == _referenced_keys(store, job)
    assert store.publish_version(job, 1, _weights(2)) == 2


def test_loser_with_identical_content_leaves_winner_intact(store: Any, job: str) -> None:
    """Identical blobs of the same version share a key: the loser must neither re-arm the
    pending expiry of the winner's committed blob nor delete it while cleaning up."""
    store.publish_version(job, NO_VERSION, _weights(1), meta={"by": "winner"})
    with pytest.raises(VersionConflictError):
        store.publish_version(job, NO_VERSION, _weights(1), meta={"by": "loser"})
    assert store.manifest(job, 1).meta == {"by": "winner"}
    assert all(ttl is None for ttl in _blob_keys(store, job).values())
    assert set(_blob_keys(store, job)) == _referenced_keys(store, job)
    for ref, weights in _weights(1).items():
        _assert_same(store.read_blob(job, 1, ref), weights)


def test_racing_threads_exactly_one_wins(harness: Harness, store: Any, job: str) -> None:
    racers = 4
    barrier = threading.Barrier(racers)
    outcomes: dict[int, object] = {}

    def race(i: int) -> None:
        blobs = _weights(100 + i)
        barrier.wait()
        try:
            outcomes[i] = store.publish_version(job, NO_VERSION, blobs)
        except VersionConflictError as exc:
            outcomes[i] = exc

    threads = [threading.Thread(target=race, args=(i,)) for i in range(racers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    winners = [i for i, o in outcomes.items() if o == 1]
    losers = [o for o in outcomes.values() if isinstance(o, VersionConflictError)]
    assert len(outcomes) == racers
    assert len(winners) == 1
    assert len(losers) == racers - 1
    assert all(exc.actual == 1 for exc in losers)
    assert store.current_version(job) == 1
    for ref, weights in _weights(100 + winners[0]).items():
        _assert_same(store.read_blob(job, 1, ref), weights)
    _assert_no_unreferenced_permanent_blob(store, job)


def test_retried_commit_is_idempotent(harness: Harness, job: str) -> None:
    """A commit whose reply was lost and is sent again must not report a conflict."""

    class RetryingStore(harness.base_cls):  # type: ignore[name-defined,misc]
        def _commit(self, *args: Any) -> tuple[str, str]:
            super()._commit(*args)
            again: tuple[str, str] = super()._commit(*args)
            return again

    store = harness.new_store(RetryingStore)
    assert store.publish_version(job, NO_VERSION, _weights(1)) == 1
    assert store.current_version(job) == 1
    assert store.versions(job) == [1]
    _assert_same(store.read_blob(job, 1, SERVER), _weights(1)[SERVER])


def test_crash_between_blob_writes_leaves_previous_version(harness: Harness, job: str) -> None:
    class CrashAfterFirstBlob(harness.base_cls):  # type: ignore[name-defined,misc]
        crash = False

        def _write_pending(self, job: str, blobs: Any) -> list[str]:
            if not self.crash:
                created: list[str] = super()._write_pending(job, blobs)
                return created
            super()._write_pending(job, blobs[:1])
            raise RuntimeError("simulated crash between blob writes")

    pending_ttl = 1.5
    store = harness.new_store(CrashAfterFirstBlob, pending_ttl_s=pending_ttl)
    store.publish_version(job, NO_VERSION, _weights(1))
    store.crash = True
    with pytest.raises(RuntimeError, match="simulated crash"):
        store.publish_version(job, 1, _weights(2))
    store.crash = False

    referenced = _referenced_keys(store, job)
    orphans = {k: ttl for k, ttl in _blob_keys(store, job).items() if k not in referenced}
    assert len(orphans) == 1, "exactly the one blob written before the crash is left over"
    assert all(ttl is not None and 0 < ttl <= pending_ttl for ttl in orphans.values())
    assert store.current_version(job) == 1
    assert store.versions(job) == [1]
    with pytest.raises(VersionNotFoundError):
        store.manifest(job, 2)
    for ref, weights in _weights(1).items():
        _assert_same(store.read_blob(job, 1, ref), weights)

    harness.wait(pending_ttl + 0.3)
    assert set(_blob_keys(store, job)) == referenced, "the orphan expired"
    assert store.publish_version(job, 1, _weights(2)) == 2


def test_manifest_naming_missing_blob_cannot_commit(harness: Harness, job: str) -> None:
    class LosesFirstBlob(harness.base_cls):  # type: ignore[name-defined,misc]
        """Writes every blob but the first, as if it had expired or been lost before commit."""

        def _write_pending(self, job: str, blobs: Any) -> list[str]:
            created: list[str] = super()._write_pending(job, blobs[1:])
            return created

    store = harness.new_store(LosesFirstBlob)
    with pytest.raises(StoreError, match="torn write") as info:
        store.publish_version(job, NO_VERSION, _weights(1))
    assert not isinstance(info.value, VersionConflictError)
    assert store.current_version(job) == NO_VERSION
    assert store.versions(job) == []
    with pytest.raises(VersionNotFoundError):
        store.manifest(job, 1)
    # The failed publisher removed the blobs it did write.
    assert _blob_keys(store, job) == {}


def test_retention_keeps_last_versions(harness: Harness, job: str) -> None:
    store = harness.new_store(keep_versions=3)
    for v in range(5):
        assert store.publish_version(job, v, _weights(v)) == v + 1
    assert store.versions(job) == [3, 4, 5]
    assert store.current_version(job) == 5
    for old in (1, 2):
        with pytest.raises(VersionNotFoundError):
            store.manifest(job, old)
        with pytest.raises(VersionNotFoundError):
            store.read_blob(job, old, SERVER)
    for kept in (3, 4, 5):
        _assert_same(store.read_blob(job, kept, AUX_C1), _weights(kept - 1)[AUX_C1])
    # Old blobs are deleted, not just unlisted.
    assert set(_blob_keys(store, job)) == _referenced_keys(store, job)
    assert len(_blob_keys(store, job)) == 3 * len(_weights(0))


def test_corrupt_blob_is_detected_on_read(harness: Harness, store: Any, job: str) -> None:
    store.publish_version(job, NO_VERSION, _weights(1))
    entry = store.manifest(job, 1).entries[SERVER]
    key = keys.blob_key(job, SERVER, 1, entry.sha256)
    harness.corrupt(store, job, key)
    with pytest.raises(DecodeError, match="sha256"):
        store.read_blob(job, 1, SERVER)
    _assert_same(store.read_blob(job, 1, CLIENT), _weights(1)[CLIENT])


def test_invalid_weights_publish_nothing(store: Any, job: str) -> None:
    bad = {SERVER: {"w": torch.tensor([1.0, float("nan")])}, CLIENT: _weights(1)[CLIENT]}
    with pytest.raises(EncodeError, match="non-finite"):
        store.publish_version(job, NO_VERSION, bad)
    with pytest.raises(ValueError, match="samples"):
        store.publish_version(job, NO_VERSION, {SERVER: _weights(1)[SERVER]}, samples={CLIENT: 3})
    with pytest.raises(ValueError, match="job name"):
        store.publish_version("bad:job", NO_VERSION, _weights(1))
    assert store.current_version(job) == NO_VERSION
    assert _blob_keys(store, job) == {}


# --- CheckpointStore: checkpoints -----------------------------------------------------------------


def test_a_lease_guarded_save_needs_the_lease(store: Any, job: str) -> None:
    # Worker "a" lost shard 0's lease to "b", which saved on top: a late save by "a" must not
    # overwrite b's checkpoint (b may already have acked the batches it covers).
    assert store.acquire_lease(job, "shard-0", "b", 30.0)
    mine = Checkpoint(0, 7, _weights(1)[SERVER], {"by": "b"})
    store.save_checkpoint(job, mine, holder=("shard-0", "b"))
    late = Checkpoint(0, 3, _weights(2)[SERVER], {"by": "a"})
    with pytest.raises(LeaseNotHeldError, match="does not hold"):
        store.save_checkpoint(job, late, holder=("shard-0", "a"))
    with pytest.raises(LeaseNotHeldError):  # nobody holds shard-1's lease
        store.save_checkpoint(
            job, Checkpoint(1, 1, _weights(2)[SERVER], {}), holder=("shard-1", "a")
        )
    kept = store.load_checkpoint(job, 0)
    assert kept is not None and (kept.applied, dict(kept.meta)) == (7, {"by": "b"})
    assert store.load_checkpoint(job, 1) is None


def test_checkpoint_round_trip_and_overwrite(harness: Harness, store: Any, job: str) -> None:
    assert store.load_checkpoint(job, 0) is None
    first = Checkpoint(0, 3, _weights(1)[SERVER], {"last_seq": {"c1": 7, "c2": 2}, "tag": b"\x00"})
    other = Checkpoint(1, 9, _weights(2)[SERVER], {"note": "shard one"})
    store.save_checkpoint(job, first)
    store.save_checkpoint(job, other)

    loaded = store.load_checkpoint(job, 0)
    assert loaded is not None
    assert (loaded.shard, loaded.applied) == (0, 3)
    assert dict(loaded.meta) == {"last_seq": {"c1": 7, "c2": 2}, "tag": b"\x00"}
    _assert_same(dict(loaded.weights), dict(first.weights))
    assert 0 < loaded.saved_at <= harness.now()

    replacement = Checkpoint(0, 5, _weights(3)[SERVER], {"last_seq": {"c1": 9}})
    store.save_checkpoint(job, replacement)
    loaded = store.load_checkpoint(job, 0)
    assert loaded is not None
    assert loaded.applied == 5
    assert dict(loaded.meta) == {"last_seq": {"c1": 9}}
    _assert_same(dict(loaded.weights), dict(replacement.weights))

    untouched = store.load_checkpoint(job, 1)
    assert untouched is not None
    assert (untouched.applied, dict(untouched.meta)) == (9, {"note": "shard one"})
    _assert_same(dict(untouched.weights), dict(other.weights))


# --- MemberStore: membership ----------------------------------------------------------------------


def test_heartbeat_expiry_and_remove(harness: Harness, store: Any, job: str) -> None:
    before = harness.now()
    store.heartbeat(job, "worker-a", 1.0, {"role": "worker", "host": "h1"})
    store.heartbeat(job, "client-b", 60.0, {"role": "client"})
    live = store.live_members(job)
    assert set(live) == {"worker-a", "client-b"}
    assert dict(live["worker-a"].info) == {"role": "worker", "host": "h1"}
    assert before + 1.0 <= live["worker-a"].expires_at <= harness.now() + 1.0
    assert live["client-b"].expires_at > live["worker-a"].expires_at

    # A heartbeat without info keeps the info registered earlier.
    store.heartbeat(job, "client-b", 60.0)
    assert dict(store.live_members(job)["client-b"].info) == {"role": "client"}

    harness.wait(1.3)
    assert set(store.live_members(job)) == {"client-b"}
    store.heartbeat(job, "worker-a", 30.0)
    assert dict(store.live_members(job)["worker-a"].info) == {}, "expired info was pruned"

    store.remove_member(job, "client-b")
    assert set(store.live_members(job)) == {"worker-a"}
    store.remove_member(job, "never-joined")
    assert set(store.live_members(job)) == {"worker-a"}


def test_renew_members_renews_only_live_ones_and_keeps_their_info(
    harness: Harness, store: Any, job: str
) -> None:
    store.heartbeat(job, "client:a", 1.0, {"shard": "0"})
    store.heartbeat(job, "client:b", 60.0, {"shard": "1"})
    store.heartbeat(job, "client:gone", 1.0, {"shard": "2"})
    store.remove_member(job, "client:gone")
    assert store.renew_members(job, [], 5.0) == []

    before = harness.now()
    assert store.renew_members(job, ["client:a", "client:never", "client:gone"], 30.0) == [
        True,
        False,
        False,
    ]
    harness.wait(1.3)  # past a's first expiry: the renewal holds it
    a = store.member(job, "client:a")
    assert a is not None and dict(a.info) == {"shard": "0"}
    assert before + 30.0 <= a.expires_at <= harness.now() + 30.0
    assert "client:never" not in store.live_members(job), "a renewal never adds a member"
    assert "client:gone" not in store.live_members(job)

    store.heartbeat(job, "client:c", 1.0, {"shard": "3"})
    harness.wait(1.3)
    # Expired, not yet pruned by a read of all members: not live, and not brought back.
    assert store.renew_members(job, ["client:c", "client:b"], 30.0) == [False, True]
    assert store.member(job, "client:c") is None
    assert set(store.live_members(job)) == {"client:a", "client:b"}
    store.heartbeat(job, "client:c", 30.0)
    assert dict(store.live_members(job)["client:c"].info) == {}, "c's old info is gone"


def test_member_reads_one_live_member(harness: Harness, store: Any, job: str) -> None:
    assert store.member(job, "client:a") is None
    store.heartbeat(job, "client:a", 1.0, {"shard": "0", "cut": "block1"})
    store.heartbeat(job, "worker:w", 60.0)
    found = store.member(job, "client:a")
    assert found is not None and found.member_id == "client:a"
    assert dict(found.info) == {"shard": "0", "cut": "block1"}
    assert found.expires_at == store.live_members(job)["client:a"].expires_at
    assert dict(store.member(job, "worker:w").info) == {}
    harness.wait(1.3)
    assert store.member(job, "client:a") is None
    store.remove_member(job, "worker:w")
    assert store.member(job, "worker:w") is None


def test_members_are_kept_and_read_by_kind(harness: Harness, store: Any, job: str) -> None:
    store.heartbeat(job, "client:a", 60.0, {"shard": "0"})
    store.heartbeat(job, "worker:w", 1.0, {"shards": "0,1"})
    store.heartbeat(job, "health:aggregator", 60.0)
    store.heartbeat(job, "m", 60.0)  # no known prefix: OTHER
    by_kind = {kind: set(store.live_members(job, kind)) for kind in MemberKind}
    assert by_kind == {
        MemberKind.CLIENT: {"client:a"},
        MemberKind.WORKER: {"worker:w"},
        MemberKind.HEALTH: {"health:aggregator"},
        MemberKind.OTHER: {"m"},
    }
    assert set(store.live_members(job)) == set().union(*by_kind.values())
    assert dict(store.live_members(job, MemberKind.WORKER)["worker:w"].info) == {"shards": "0,1"}

    # One renewal over several kinds answers in the order asked.
    ids = ["worker:w", "client:never", "client:a", "m", "worker:never"]
    assert store.renew_members(job, ids, 60.0) == [True, False, True, True, False]
    harness.wait(1.3)  # past w's first expiry: the renewal holds it
    assert set(store.live_members(job, MemberKind.WORKER)) == {"worker:w"}
    assert store.member(job, "worker:w") is not None and store.member(job, "client:w") is None

    store.remove_member(job, "worker:w")
    assert store.live_members(job, MemberKind.WORKER) == {}
    assert set(store.live_members(job, MemberKind.CLIENT)) == {"client:a"}


def test_member_ttls_tell_seconds_left_and_prune_the_expired(
    harness: Harness, store: Any, job: str
) -> None:
    assert store.member_ttls(job, []) == []
    store.heartbeat(job, "client:a", 1.0, {"shard": "0"})
    store.heartbeat(job, "client:b", 60.0, {"shard": "1"})
    store.heartbeat(job, "worker:w", 30.0)
    b, never, w = store.member_ttls(job, ["client:b", "client:never", "worker:w"])
    assert never is None
    assert 59.0 < b <= 60.0 and 29.0 < w <= 30.0
    assert b == pytest.approx(store.member(job, "client:b").expires_at - harness.now(), abs=0.5)

    harness.wait(1.3)
    assert store.member_ttls(job, ["client:a", "client:b"])[0] is None
    store.heartbeat(job, "client:a", 30.0)  # back without info: the expired info was pruned
    assert dict(store.member(job, "client:a").info) == {}
    assert dict(store.member(job, "client:b").info) == {"shard": "1"}, "live ones untouched"


# --- MemberStore: leases --------------------------------------------------------------------------


def test_leases_are_exclusive_and_expire(harness: Harness, store: Any, job: str) -> None:
    assert lease_owner(store, job, "shard-0") is None
    assert store.acquire_lease(job, "shard-0", "w1", 30.0)
    assert not store.acquire_lease(job, "shard-0", "w2", 30.0)
    assert store.acquire_lease(job, "shard-0", "w1", 30.0), "the owner renews"
    assert store.acquire_lease(job, "shard-1", "w2", 30.0), "leases are independent"
    assert lease_owner(store, job, "shard-0") == "w1"

    store.release_lease(job, "shard-0", "w2")
    assert lease_owner(store, job, "shard-0") == "w1", "only the owner releases"
    store.release_lease(job, "shard-0", "w1")
    assert lease_owner(store, job, "shard-0") is None
    assert store.acquire_lease(job, "shard-0", "w2", 1.0)

    harness.wait(1.3)
    assert lease_owner(store, job, "shard-0") is None, "the lease expired"
    assert store.acquire_lease(job, "shard-0", "w1", 30.0)
    assert lease_owner(store, job, "shard-0") == "w1"
    assert lease_owner(store, job, "shard-1") == "w2"


# --- MemberStore: how the job ended ---------------------------------------------------------------


def test_job_status_is_recorded_replaced_and_cleared(store: Any, job: str) -> None:
    neighbour = job + "x"
    assert store.job_status(job) is None, "a job that never ran has not ended"
    failed = JobStatus("failed", "3 consecutive attempts at round 2; non_finite ×4")
    store.set_job_status(job, failed)
    assert store.job_status(job) == failed
    assert store.job_status(job).text == "failed: 3 consecutive attempts at round 2; non_finite ×4"
    assert store.job_status(neighbour) is None

    # Replaced whole: a finished job keeps no detail of an earlier failure.
    store.set_job_status(job, JobStatus("finished"))
    assert store.job_status(job) == JobStatus("finished", "")
    assert store.job_status(job).text == "finished"

    store.set_job_status(neighbour, JobStatus("finished"))
    store.clear_job_status(job)
    assert store.job_status(job) is None
    store.clear_job_status(job)  # clearing twice is harmless
    assert store.job_status(neighbour) == JobStatus("finished")


def test_job_status_refuses_unknown_states() -> None:
    with pytest.raises(ValueError, match="job state"):
        JobStatus("running")
    assert JobStatus("failed").text == "failed: no reason given"


# --- ScheduleStore: the run's schedule record ---------------------------------------------------


def test_schedule_keeps_append_order_per_stream(store: Any, job: str) -> None:
    store.append_schedule(job, "aggregator", ['{"a":1}', '{"a":2}'])
    store.append_schedule(job, "shard-0", ['{"s":1}'])
    store.append_schedule(job, "aggregator", ['{"a":3}'])
    store.append_schedule(job, "shard-0", [])  # nothing: no stream appears for it
    store.append_schedule(job, "coordinator", [])
    store.append_schedule(job, "shard-0", ['{"s":2}', '{"s":3}'])
    assert store.read_schedule(job) == {
        "aggregator": ['{"a":1}', '{"a":2}', '{"a":3}'],
        "shard-0": ['{"s":1}', '{"s":2}', '{"s":3}'],
    }


def test_schedule_lines_come_back_as_given(store: Any, job: str) -> None:
    lines = ['{"client":"c-é","x":"a b\\n"}', " ", "x" * 5000]
    store.append_schedule(job, "shard-12", lines)
    assert store.read_schedule(job) == {"shard-12": lines}


def test_schedule_of_an_unknown_job_is_empty(store: Any, job: str) -> None:
    assert store.read_schedule(job) == {}
    store.append_schedule(job, "aggregator", ["{}"])
    assert store.read_schedule(job + "x") == {}, "a job sharing the prefix as a string"


def test_schedule_refuses_bad_stream_names(store: Any, job: str) -> None:
    for bad in ("", "a:b", "a*", "-x", "x" * 65):
        with pytest.raises(ValueError, match="stream"):
            store.append_schedule(job, bad, ["{}"])
    assert store.read_schedule(job) == {}


def test_schedule_appends_from_threads_are_each_whole(harness: Harness, job: str) -> None:
    """Two writers on one stream: each append's lines stay together and in order."""
    first = harness.new_store()
    # Redis: two clients of the server; memory: one store (it is one process's).
    stores = [first, first if harness.kind == "memory" else harness.new_store()]

    def write(i: int) -> None:
        for n in range(20):
            stores[i].append_schedule(job, "aggregator", [f"{i}:{n}:a", f"{i}:{n}:b"])

    threads = [threading.Thread(target=write, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    lines = stores[0].read_schedule(job)["aggregator"]
    assert len(lines) == 80
    for first, second in zip(lines[::2], lines[1::2], strict=True):
        assert first.endswith(":a") and second == first[:-1] + "b"
    for i in range(2):
        assert [x for x in lines[::2] if x.startswith(f"{i}:")] == [f"{i}:{n}:a" for n in range(20)]


def test_schedule_is_deleted_with_the_job(store: Any, job: str) -> None:
    for name in (job, job + "x"):
        store.append_schedule(name, "aggregator", ["{}"])
        store.append_schedule(name, "shard-0", ["{}"])
    store.delete_job(job)
    assert store.read_schedule(job) == {}
    assert store.read_schedule(job + "x") == {"aggregator": ["{}"], "shard-0": ["{}"]}
    store.append_schedule(job, "shard-0", ["{}"])
    assert store.read_schedule(job) == {"shard-0": ["{}"]}, "a new run starts afresh"


# --- WeightStore: operations ----------------------------------------------------------------------


def test_delete_job_removes_everything_of_that_job_only(store: Any, job: str) -> None:
    neighbour = job + "x"  # shares the prefix as a string; must survive
    for name in (job, neighbour):
        store.publish_version(name, NO_VERSION, _weights(1))
        store.save_checkpoint(name, Checkpoint(0, 1, _weights(1)[SERVER]))
        for member in ("m", "client:c", "worker:w", "health:coordinator"):
            store.heartbeat(name, member, 60.0)
        assert store.acquire_lease(name, "shard-0", "w", 60.0)
        store.set_job_status(name, JobStatus("failed", "diverged"))
        store.append_schedule(name, "aggregator", ["{}"])

    store.delete_job(job)
    assert store.current_version(job) == NO_VERSION
    assert store.versions(job) == []
    assert _blob_keys(store, job) == {}
    assert store.load_checkpoint(job, 0) is None
    assert store.live_members(job) == {}
    assert lease_owner(store, job, "shard-0") is None
    assert store.job_status(job) is None
    assert store.read_schedule(job) == {}
    assert store.publish_version(job, NO_VERSION, _weights(2)) == 1, "the job starts afresh"

    assert store.current_version(neighbour) == 1
    _assert_same(store.read_blob(neighbour, 1, SERVER), _weights(1)[SERVER])
    assert store.load_checkpoint(neighbour, 0) is not None
    assert set(store.live_members(neighbour)) == {"m", "client:c", "worker:w", "health:coordinator"}
    assert lease_owner(store, neighbour, "shard-0") == "w"
    assert store.job_status(neighbour) == JobStatus("failed", "diverged")
    assert store.read_schedule(neighbour) == {"aggregator": ["{}"]}


# --- Redis only: what a single process cannot show -----------------------------------------

_RACER = r"""
import json, sys
import torch
from broker.errors import VersionConflictError
from broker.redis_store import RedisWeightStore
from broker.store import BlobRef

url, job, tag = sys.argv[1], sys.argv[2], float(sys.argv[3])
store = RedisWeightStore(url)
blobs = {BlobRef("server"): {"w": torch.full((512, 512), tag)}}
store.current_version(job)  # connected before the start signal
print("ready", flush=True)
sys.stdin.readline()
try:
    print(json.dumps({"won": store.publish_version(job, 0, blobs)}), flush=True)
except VersionConflictError as exc:
    print(json.dumps({"lost": exc.actual}), flush=True)
finally:
    store.close()
"""


@pytest.mark.redis
@pytest.mark.slow
def test_racing_processes_exactly_one_wins(redis_url: str, job: str) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _RACER, redis_url, job, str(tag)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=REPO_ROOT,
            env=env,
        )
        for tag in (1.0, 2.0)
    ]
    store = RedisWeightStore(redis_url)
    try:
        for p in procs:
            assert p.stdout is not None and p.stdout.readline().strip() == "ready"
        for p in procs:
            assert p.stdin is not None
            p.stdin.write("go\n")
            p.stdin.flush()
        results = [json.loads(p.communicate(timeout=60)[0]) for p in procs]
        assert all(p.returncode == 0 for p in procs)

        assert sorted(results, key=str) == [{"lost": 1}, {"won": 1}]
        winner_tag = (1.0, 2.0)[results.index({"won": 1})]
        assert store.current_version(job) == 1
        blob = store.read_blob(job, 1, BlobRef("server"))
        assert torch.equal(blob["w"], torch.full((512, 512), winner_tag))
        _assert_no_unreferenced_permanent_blob(store, job)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        store.delete_job(job)
        store.close()


@pytest.mark.redis
def test_members_of_the_layout_before_kinds_are_ignored_and_deleted(
    redis_url: str, job: str
) -> None:
    """A job's store written before the member kinds (one `<job>:members` sorted set and one
    `<job>:members:info` hash for every kind) is not read: those members join again."""
    raw = redis.Redis.from_url(redis_url)
    store = RedisWeightStore(redis_url)
    try:
        old, old_info = keys.job_prefix(job) + "members", keys.job_prefix(job) + "members:info"
        raw.zadd(old, {"client:a": time.time() + 600})
        raw.hset(old_info, "client:a", "{}")
        assert store.live_members(job) == {} and store.member(job, "client:a") is None
        assert store.renew_members(job, ["client:a"], 60.0) == [False]
        store.delete_job(job)
        assert raw.exists(old, old_info) == 0
    finally:
        store.delete_job(job)
        store.close()
        raw.close()


@pytest.mark.redis
def test_redis_server_info(redis_url: str) -> None:
    store = RedisWeightStore(redis_url)
    try:
        info = store.server_info()
        assert info.can_write and info.can_read
        assert info.version.split(".")[0].isdigit()
        assert info.aof_enabled == ("AOF is off" not in " ".join(info.problems))
        assert not any(k.startswith(b"splitmq:_probe:") for k in _scan_probe_keys(redis_url))
    finally:
        store.close()


def _scan_probe_keys(url: str) -> list[bytes]:
    client = redis.Redis.from_url(url)
    try:
        return list(client.scan_iter(match="splitmq:_probe:*"))
    finally:
        client.close()


def test_redis_unreachable_is_store_unavailable() -> None:
    # Port 1 on localhost refuses connections at once.
    store = RedisWeightStore(
        "redis://127.0.0.1:1/0", RedisStoreOptions(socket_connect_timeout_s=1.0, retries=0)
    )
    try:
        with pytest.raises(StoreUnavailableError):
            store.current_version("anyjob")
    finally:
        store.close()


def test_rejects_non_redis_url() -> None:
    with pytest.raises(ValueError, match="redis"):
        RedisWeightStore("http://127.0.0.1:6379/0")
