"""`InMemoryWeightStore`: the embedded default, a single-process stand-in for Redis that holds
the same bytes under the same key names (`broker.store_codec`).

Expiry is driven by an injected clock, which lets tests expire heartbeats, leases and pending
blobs without sleeping.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from broker import keys
from broker.errors import StoreError, VersionNotFoundError
from broker.store import (
    NO_VERSION,
    BlobRef,
    Checkpoint,
    JobStatus,
    Manifest,
    Member,
    MemberKind,
)
from broker.store_codec import (
    PreparedBlob,
    PublishingStore,
    decode_blob,
    decode_checkpoint,
    encode_checkpoint,
    lease_not_held,
    positive_ttl,
    str_map,
)

if TYPE_CHECKING:
    import torch


@dataclass
class _Blob:
    data: bytes
    expires_at: float | None  # None once committed


@dataclass(frozen=True)
class _Version:
    manifest: Manifest  # its blobs' keys follow from the entries (`keys.blob_key`)
    commit_id: str


# What `decode_checkpoint` takes after the shard: applied, weights, sha256, meta, saved_at.
_StoredCheckpoint = tuple[int, bytes, str, bytes, float]


@dataclass(frozen=True)
class _Lease:
    owner: str
    expires_at: float


@dataclass
class _JobState:
    version: int = NO_VERSION
    versions: dict[int, _Version] = field(default_factory=dict)
    blobs: dict[str, _Blob] = field(default_factory=dict)
    checkpoints: dict[int, _StoredCheckpoint] = field(default_factory=dict)
    # One map a kind, as Redis keeps one sorted set a kind.
    members: dict[MemberKind, dict[str, Member]] = field(
        default_factory=lambda: {kind: {} for kind in MemberKind}
    )
    leases: dict[str, _Lease] = field(default_factory=dict)
    status: JobStatus | None = None
    # The schedule record: stream -> encoded entries, in append order.
    schedule: dict[str, list[str]] = field(default_factory=dict)

    def kind(self, member_id: str) -> dict[str, Member]:
        return self.members[keys.member_kind(member_id)]

    def sweep(self, now: float) -> None:
        """Forget everything whose expiry has passed (Redis does this by itself)."""
        _prune(self.blobs, now)
        for members in self.members.values():
            _prune(members, now)
        _prune(self.leases, now)


def _expired(expires_at: float | None, now: float) -> bool:
    return expires_at is not None and expires_at <= now


def _prune(records: dict[str, _Blob] | dict[str, Member] | dict[str, _Lease], now: float) -> None:
    for key in [k for k, r in records.items() if _expired(r.expires_at, now)]:
        del records[key]


class InMemoryWeightStore(PublishingStore):
    """Thread-safe; one lock guards all state, and serialisation happens outside it."""

    def __init__(
        self,
        *,
        keep_versions: int = 5,
        pending_ttl_s: float = 600.0,  # as the Redis store's options
        clock: Callable[[], float] = time.time,
    ) -> None:
        if keep_versions < 1:
            raise ValueError(f"keep_versions must be >= 1, got {keep_versions}")
        self._keep_versions = keep_versions
        self._pending_ttl_s = positive_ttl(pending_ttl_s)
        self._clock = clock
        self._lock = threading.Lock()
        self._jobs: dict[str, _JobState] = {}

    @contextmanager
    def _job(self, job: str, *, create: bool = False) -> Iterator[_JobState]:
        """The job's state swept of expired entries, under the lock (an empty one, unstored, for
        an unknown job unless `create`)."""
        keys.validate_job(job)
        with self._lock:
            state = self._jobs.get(job)
            if state is None:
                state = _JobState()
                if create:
                    self._jobs[job] = state
            state.sweep(self._clock())
            yield state

    # --- versions -----------------------------------------------------------------------------
    def current_version(self, job: str) -> int:
        with self._job(job) as state:
            return state.version

    def _write_pending(self, job: str, blobs: Sequence[PreparedBlob]) -> list[str]:
        created = []
        with self._job(job, create=True) as state:
            expires_at = self._clock() + self._pending_ttl_s
            for blob in blobs:
                if blob.key not in state.blobs:
                    state.blobs[blob.key] = _Blob(blob.data, expires_at)
                    created.append(blob.key)
        return created

    def _commit(
        self,
        job: str,
        expected: int,
        blobs: Sequence[PreparedBlob],
        commit_id: str,
        meta: Mapping[str, str],
    ) -> tuple[str, str]:
        version = expected + 1
        with self._job(job, create=True) as state:
            if state.version != expected:
                mine = state.versions.get(version)
                if state.version > expected and mine is not None and mine.commit_id == commit_id:
                    return "ok", ""  # a retry of our own commit
                return "conflict", str(state.version)
            missing = [b.key for b in blobs if b.key not in state.blobs]
            if missing:
                return "missing", missing[0]
            for blob in blobs:
                state.blobs[blob.key].expires_at = None
            manifest = Manifest(
                version=version,
                entries={b.entry.ref: b.entry for b in blobs},
                created_at=self._clock(),
                meta=dict(meta),
            )
            state.versions[version] = _Version(manifest, commit_id)
            state.version = version
        return "ok", ""

    def _discard_pending(self, job: str, blob_keys: Sequence[str]) -> None:
        with self._job(job) as state:
            for key in blob_keys:
                blob = state.blobs.get(key)
                if blob is not None and blob.expires_at is not None:
                    del state.blobs[key]

    def _apply_retention(self, job: str) -> None:
        with self._job(job) as state:
            for version in sorted(state.versions)[: -self._keep_versions]:
                for entry in state.versions.pop(version).manifest.entries.values():
                    state.blobs.pop(keys.blob_key(job, entry.ref, version, entry.sha256), None)

    def manifest(self, job: str, version: int) -> Manifest:
        with self._job(job) as state:
            record = state.versions.get(version)
        if record is None:
            raise VersionNotFoundError(f"job {job}: version {version} is not retained")
        m = record.manifest
        # A copy: callers must not be able to edit the stored manifest through its dicts.
        return Manifest(m.version, dict(m.entries), m.created_at, dict(m.meta))

    def read_blob(self, job: str, version: int, ref: BlobRef) -> dict[str, torch.Tensor]:
        with self._job(job) as state:
            record = state.versions.get(version)
            if record is None:
                raise VersionNotFoundError(f"job {job}: version {version} is not retained")
            entry = record.manifest.entries.get(ref)
            if entry is None:
                raise StoreError(f"job {job}: version {version} has no blob {ref.name}")
            key = keys.blob_key(job, ref, version, entry.sha256)
            blob = state.blobs.get(key)
        return decode_blob(job, version, key, entry, None if blob is None else blob.data)

    def versions(self, job: str) -> list[int]:
        with self._job(job) as state:
            return sorted(state.versions)

    # --- shard checkpoints --------------------------------------------------------------------
    def save_checkpoint(
        self, job: str, checkpoint: Checkpoint, *, holder: tuple[str, str] | None = None
    ) -> None:
        data, sha256, meta = encode_checkpoint(checkpoint)
        stored = (int(checkpoint.applied), data, sha256, meta, self._clock())
        with self._job(job, create=True) as state:
            if holder is not None:
                lease = state.leases.get(holder[0])
                if lease is None or lease.owner != holder[1] or lease.expires_at <= self._clock():
                    raise lease_not_held(checkpoint.shard, holder)
            state.checkpoints[int(checkpoint.shard)] = stored

    def load_checkpoint(self, job: str, shard: int) -> Checkpoint | None:
        with self._job(job) as state:
            stored = state.checkpoints.get(int(shard))
        if stored is None:
            return None
        return decode_checkpoint(f"checkpoint {keys.checkpoint_key(job, shard)}", shard, *stored)

    # --- membership ---------------------------------------------------------------------------
    def heartbeat(
        self, job: str, member_id: str, ttl_s: float, info: Mapping[str, str] | None = None
    ) -> None:
        keys.validate_name("member id", member_id)
        ttl = positive_ttl(ttl_s)
        with self._job(job, create=True) as state:
            members = state.kind(member_id)
            previous = members.get(member_id)
            kept = previous.info if previous is not None else {}
            members[member_id] = Member(
                member_id,
                self._clock() + ttl,
                str_map("member info", info) if info is not None else kept,
            )

    def renew_members(self, job: str, member_ids: Sequence[str], ttl_s: float) -> list[bool]:
        ttl = positive_ttl(ttl_s)
        with self._job(job) as state:
            expires_at = self._clock() + ttl
            live = []
            for member_id in member_ids:
                members = state.kind(member_id)
                member = members.get(member_id)
                if member is not None:
                    members[member_id] = Member(member_id, expires_at, member.info)
                live.append(member is not None)
            return live

    def member(self, job: str, member_id: str) -> Member | None:
        with self._job(job) as state:
            return state.kind(member_id).get(member_id)

    def remove_member(self, job: str, member_id: str) -> None:
        with self._job(job) as state:
            state.kind(member_id).pop(member_id, None)

    def live_members(self, job: str, kind: MemberKind | None = None) -> dict[str, Member]:
        with self._job(job) as state:
            if kind is not None:
                return dict(state.members[kind])
            return {m: r for members in state.members.values() for m, r in members.items()}

    def member_ttls(self, job: str, member_ids: Sequence[str]) -> list[float | None]:
        with self._job(job) as state:  # swept: the expired ones are gone already
            now = self._clock()
            found = (state.kind(member_id).get(member_id) for member_id in member_ids)
            return [None if m is None else m.expires_at - now for m in found]

    # --- leases -------------------------------------------------------------------------------
    def acquire_lease(self, job: str, name: str, owner: str, ttl_s: float) -> bool:
        keys.validate_name("lease name", name)
        keys.validate_name("lease owner", owner)
        ttl = positive_ttl(ttl_s)
        with self._job(job, create=True) as state:
            lease = state.leases.get(name)
            if lease is not None and lease.owner != owner:
                return False
            state.leases[name] = _Lease(owner, self._clock() + ttl)
            return True

    def release_lease(self, job: str, name: str, owner: str) -> None:
        with self._job(job) as state:
            lease = state.leases.get(name)
            if lease is not None and lease.owner == owner:
                del state.leases[name]

    # --- how the job ended --------------------------------------------------------------------
    def set_job_status(self, job: str, status: JobStatus) -> None:
        with self._job(job, create=True) as state:  # frozen: stored as given
            state.status = status

    def job_status(self, job: str) -> JobStatus | None:
        with self._job(job) as state:
            return state.status

    def clear_job_status(self, job: str) -> None:
        with self._job(job) as state:
            state.status = None

    # --- the schedule record ------------------------------------------------------------------
    def append_schedule(self, job: str, stream: str, lines: Sequence[str]) -> None:
        keys.validate_stream(stream)
        if not lines:
            return
        with self._job(job, create=True) as state:
            state.schedule.setdefault(stream, []).extend(lines)

    def read_schedule(self, job: str) -> dict[str, list[str]]:
        with self._job(job) as state:  # copies: the caller's lists are its own
            return {name: list(lines) for name, lines in sorted(state.schedule.items())}

    # --- operations ---------------------------------------------------------------------------
    def restore_version(
        self,
        job: str,
        version: int,
        blobs: Mapping[BlobRef, Mapping[str, torch.Tensor]],
        *,
        samples: Mapping[BlobRef, int] | None = None,
        meta: Mapping[str, str] | None = None,
    ) -> int:
        """Publish `blobs` as version `version` of a job that has none yet: a stopped embedded
        run's last version, read back from its run directory (`splitmq run --resume`), so that
        the rounds go on from its number. Call it before any role runs."""
        if isinstance(version, bool) or not isinstance(version, int) or version <= NO_VERSION:
            raise ValueError(f"version must be an int > {NO_VERSION}, got {version!r}")
        with self._job(job, create=True) as state:
            if state.version != NO_VERSION:
                raise StoreError(f"job {job} has version {state.version} already")
            # The next publication commits `version`; no reader runs before it.
            state.version = version - 1
        try:
            return self.publish_version(job, version - 1, blobs, samples=samples, meta=meta)
        except BaseException:
            with self._job(job) as state:
                state.version = NO_VERSION
            raise

    def delete_job(self, job: str) -> None:
        keys.validate_job(job)
        with self._lock:
            self._jobs.pop(job, None)

    def close(self) -> None:
        """Nothing to release; kept for the protocol."""
