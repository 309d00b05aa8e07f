"""`RedisWeightStore`: the `WeightStore` over Redis (redis-py), key schema in `broker.keys`.

Every multi-key step that must be atomic is one Lua script (`broker.redis_scripts`) or one
MULTI/EXEC, and every step is idempotent, so redis-py's retry after a lost reply is harmless.
redis errors never escape: connection problems become `StoreUnavailableError`, the rest
`StoreError`.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse

import redis
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

from broker import keys, redis_scripts
from broker.errors import (
    ConnectionSettingsError,
    LeaseNotHeldError,
    StoreAuthError,
    StoreError,
    StoreUnavailableError,
    VersionConflictError,
    VersionNotFoundError,
)
from broker.store import (
    NO_VERSION,
    BlobRef,
    Checkpoint,
    JobStatus,
    Manifest,
    ManifestEntry,
    Member,
)
from broker.store_codec import (
    BLOB_FIELD_PREFIX,
    PreparedBlob,
    blob_field,
    decode_entry,
    decode_info,
    decode_meta,
    encode_entry,
    encode_info,
    encode_meta,
)
from broker.store_publish import PublishingStore
from broker.tls import TLSOptions, redis_ssl_kwargs

# torch, and `broker.weights` with it, are imported where weights move, not here: a store
# opened only for members and health keys (`splitmq check`, every few seconds) starts fast.
if TYPE_CHECKING:
    import torch

_SCAN_COUNT = 500
_DELETE_BATCH = 500


@dataclass(frozen=True)
class RedisStoreOptions:
    # Generous read timeout: one blob can be tens of MB over a slow link.
    socket_timeout_s: float = 30.0
    socket_connect_timeout_s: float = 5.0
    # Seconds between PINGs on idle pooled connections, so a dead one is noticed before use.
    health_check_interval_s: int = 30
    # Retries of a command after a connection error or timeout (every step is idempotent).
    retries: int = 2
    keep_versions: int = 5
    # How long an uncommitted blob lives: long enough for a slow publisher to commit.
    pending_ttl_s: float = 600.0
    max_connections: int | None = None
    client_name: str = "splitmq-store"
    # TLS for rediss:// URLs (None: system CAs, hostname checked); refused with redis://.
    tls: TLSOptions | None = None

    def __post_init__(self) -> None:
        if self.keep_versions < 1:
            raise ValueError(f"keep_versions must be >= 1, got {self.keep_versions}")
        if not self.pending_ttl_s > 0:
            raise ValueError(f"pending_ttl_s must be positive, got {self.pending_ttl_s}")


@dataclass(frozen=True)
class RedisServerInfo:
    """What `splitmq doctor` reports about the Redis behind the store."""

    version: str
    mode: str
    can_write: bool
    can_read: bool
    aof_enabled: bool
    aof_last_write_status: str
    maxmemory_bytes: int
    maxmemory_policy: str
    used_memory_bytes: int
    problems: tuple[str, ...]
    # appendfsync ("always", "everysec", "no"; "unknown" where CONFIG is not allowed).
    aof_fsync: str = "unknown"

    @property
    def healthy(self) -> bool:
        return self.can_write and self.can_read


@contextmanager
def _redis_errors(what: str) -> Iterator[None]:
    try:
        yield
    except redis.AuthenticationError as exc:  # a ConnectionError to redis-py; retrying won't help
        raise StoreAuthError(
            f"Redis refused the credentials of store.redis_url during {what}: {exc}"
        ) from exc
    except (redis.ConnectionError, redis.TimeoutError) as exc:
        raise StoreUnavailableError(f"redis unreachable during {what}: {exc}") from exc
    except redis.RedisError as exc:
        raise StoreError(f"redis error during {what}: {exc}") from exc


def _as_bytes(raw: object) -> bytes:
    # decode_responses=False makes every reply bytes; the check narrows redis-py's loose types.
    if isinstance(raw, bytes):
        return raw
    if isinstance(raw, str):
        return raw.encode()
    raise StoreError(f"unexpected redis reply {raw!r}")


def _text(raw: object) -> str:
    return _as_bytes(raw).decode()


def _hash(fields: Mapping[Any, Any]) -> dict[bytes, bytes]:
    return {_as_bytes(k): _as_bytes(v) for k, v in fields.items()}


def _ms(ttl_s: float) -> int:
    if not ttl_s > 0:
        raise ValueError(f"ttl must be positive, got {ttl_s!r}")
    return max(1, round(ttl_s * 1000))


def _parse_manifest(job: str, version: int, fields: Mapping[bytes, bytes]) -> Manifest:
    entries: dict[BlobRef, ManifestEntry] = {}
    for name, raw in fields.items():
        if name.startswith(BLOB_FIELD_PREFIX.encode()):
            _, entry = decode_entry(raw)
            entries[entry.ref] = entry
    try:
        meta = json.loads(fields.get(b"meta", b"{}"))
        created_at = float(fields.get(b"created_at", b"0"))
    except ValueError as exc:
        raise StoreError(f"job {job}: malformed manifest of version {version}: {exc}") from exc
    return Manifest(
        version=version,
        entries=entries,
        created_at=created_at,
        meta={str(k): str(v) for k, v in meta.items()},
    )


class RedisWeightStore(PublishingStore):
    """Thread-safe (redis-py's connection pool); one instance per process is enough."""

    def __init__(self, url: str, options: RedisStoreOptions | None = None) -> None:
        scheme = urlparse(url).scheme
        if scheme not in ("redis", "rediss"):
            got = f"{scheme}://" if scheme else "no scheme"
            raise ConnectionSettingsError(
                f"the Redis URL must start with redis:// or rediss://, got {got} "
                "(store.redis_url, SPLITMQ_REDIS_URL)"
            )
        self._options = options or RedisStoreOptions()
        opts = self._options
        if scheme == "rediss":
            tls: dict[str, Any] = redis_ssl_kwargs(opts.tls or TLSOptions())
        elif opts.tls is not None:
            raise ConnectionSettingsError(
                "TLS options are set but the Redis URL is redis://: use rediss://"
            )
        else:
            tls = {}
        # No connection is opened here: the first command connects.
        self._redis = redis.Redis.from_url(
            url,
            socket_timeout=opts.socket_timeout_s,
            socket_connect_timeout=opts.socket_connect_timeout_s,
            health_check_interval=opts.health_check_interval_s,
            retry=Retry(ExponentialBackoff(cap=1.0, base=0.05), opts.retries),
            max_connections=opts.max_connections,
            client_name=opts.client_name,
            decode_responses=False,
            **tls,
        )
        self._scripts = redis_scripts.register(self._redis)

    # --- versions -----------------------------------------------------------------------------
    def current_version(self, job: str) -> int:
        with _redis_errors("current_version"):
            raw = self._redis.get(keys.version_key(job))
        return NO_VERSION if raw is None else int(raw)

    def _write_pending(self, job: str, blobs: Sequence[PreparedBlob]) -> list[str]:
        if not blobs:
            return []
        ttl_ms = _ms(self._options.pending_ttl_s)
        # NX: an identical blob (same content, same version) may already be committed by a
        # racing publisher; overwriting it would put a pending expiry back on a live blob.
        with _redis_errors("blob write"):
            pipe = self._redis.pipeline(transaction=False)
            for blob in blobs:
                pipe.set(blob.key, blob.data, px=ttl_ms, nx=True)
            results = pipe.execute()
        return [blob.key for blob, created in zip(blobs, results, strict=True) if created]

    def _commit(
        self,
        job: str,
        expected: int,
        blobs: Sequence[PreparedBlob],
        commit_id: str,
        meta: Mapping[str, str],
    ) -> None:
        version = expected + 1
        script_keys = [
            keys.version_key(job),
            keys.versions_key(job),
            keys.manifest_key(job, version),
            *(blob.key for blob in blobs),
        ]
        args: list[str | int] = [expected, commit_id, json.dumps(dict(meta), sort_keys=True)]
        for blob in blobs:
            args += [blob_field(blob.entry.ref), encode_entry(blob)]
        with _redis_errors("commit"):
            reply = self._scripts.publish(keys=script_keys, args=args)
        status, detail = _text(reply[0]), _text(reply[1])
        if status == "conflict":
            raise VersionConflictError(expected, int(detail))
        if status == "missing":
            raise StoreError(
                f"torn write: blob {detail} is missing at commit time; "
                f"version {expected} stays current"
            )
        if status != "ok":
            raise StoreError(f"unexpected publish reply {reply!r}")

    def _discard_pending(self, job: str, blob_keys: Sequence[str]) -> None:
        if blob_keys:
            with _redis_errors("discard pending blobs"):
                self._scripts.discard_pending(keys=list(blob_keys))

    def _apply_retention(self, job: str) -> None:
        with _redis_errors("retention"):
            newest_dropped = -(self._options.keep_versions + 1)
            for raw in self._redis.zrange(keys.versions_key(job), 0, newest_dropped):
                self._drop_version(job, int(_as_bytes(raw)))

    def _drop_version(self, job: str, version: int) -> None:
        """Remove one version whole: index entry, manifest and blobs in one MULTI/EXEC."""
        manifest_key = keys.manifest_key(job, version)
        fields = _hash(self._redis.hgetall(manifest_key))
        blob_keys = [
            decode_entry(raw)[0]
            for name, raw in fields.items()
            if name.startswith(BLOB_FIELD_PREFIX.encode())
        ]
        pipe = self._redis.pipeline(transaction=True)
        pipe.zrem(keys.versions_key(job), str(version))
        pipe.unlink(manifest_key, *blob_keys)
        pipe.execute()

    def manifest(self, job: str, version: int) -> Manifest:
        with _redis_errors("manifest read"):
            fields = _hash(self._redis.hgetall(keys.manifest_key(job, version)))
        if not fields:
            raise VersionNotFoundError(f"job {job}: version {version} is not retained")
        return _parse_manifest(job, version, fields)

    def read_blob(self, job: str, version: int, ref: BlobRef) -> dict[str, torch.Tensor]:
        manifest_key = keys.manifest_key(job, version)
        with _redis_errors("blob read"):
            pipe = self._redis.pipeline(transaction=False)
            pipe.exists(manifest_key)
            pipe.hget(manifest_key, blob_field(ref))
            exists, raw_entry = pipe.execute()
            if not exists:
                raise VersionNotFoundError(f"job {job}: version {version} is not retained")
            if raw_entry is None:
                raise StoreError(f"job {job}: version {version} has no blob {ref.name}")
            key, entry = decode_entry(raw_entry)
            data = self._redis.get(key)
        if data is None:
            # Retention removed the version between the manifest read and this one.
            raise VersionNotFoundError(f"job {job}: blob {key} of version {version} is gone")
        from broker.weights import decode_verified

        return decode_verified(_as_bytes(data), entry.sha256, entry.nbytes, key)

    def versions(self, job: str) -> list[int]:
        with _redis_errors("versions"):
            raw = self._redis.zrange(keys.versions_key(job), 0, -1)
        return [int(_as_bytes(v)) for v in raw]

    def blob_keys(self, job: str) -> dict[str, float | None]:
        """Every blob key of the job -> seconds until it expires (None: committed)."""
        with _redis_errors("blob scan"):
            found = [
                _text(k)
                for k in self._redis.scan_iter(match=keys.blob_pattern(job), count=_SCAN_COUNT)
            ]
            pipe = self._redis.pipeline(transaction=False)
            for key in found:
                pipe.pttl(key)
            ttls = pipe.execute()
        # PTTL: -1 no expiry, -2 gone since the scan.
        pairs = zip(found, ttls, strict=True)
        return {k: None if t == -1 else t / 1000 for k, t in pairs if t != -2}

    # --- shard checkpoints --------------------------------------------------------------------
    def save_checkpoint(
        self, job: str, checkpoint: Checkpoint, *, holder: tuple[str, str] | None = None
    ) -> None:
        from broker.weights import encode_weights, sha256_hex

        key = keys.checkpoint_key(job, checkpoint.shard)
        data = encode_weights(checkpoint.weights)
        args: list[bytes | str | int] = [
            data,
            sha256_hex(data),
            int(checkpoint.applied),
            encode_meta(checkpoint.meta),
        ]
        script_keys = [key]
        if holder is not None:
            script_keys.append(keys.lease_key(job, holder[0]))
            args.append(holder[1])
        with _redis_errors("checkpoint save"):
            saved = self._scripts.save_checkpoint(keys=script_keys, args=args)
        if holder is not None and saved == -1:  # the script returns -1 (an integer) or a time
            raise LeaseNotHeldError(
                f"checkpoint of shard {checkpoint.shard} not saved: {holder[1]!r} does not hold "
                f"lease {holder[0]!r}"
            )

    def load_checkpoint(self, job: str, shard: int) -> Checkpoint | None:
        key = keys.checkpoint_key(job, shard)
        with _redis_errors("checkpoint load"):
            fields = _hash(self._redis.hgetall(key))
        if not fields:
            return None
        try:
            data = fields[b"weights"]
            sha = _text(fields[b"sha256"])
            applied = int(fields[b"applied"])
            meta = fields[b"meta"]
            saved_at = float(fields[b"saved_at"])
        except (KeyError, ValueError) as exc:
            raise StoreError(f"malformed checkpoint {key}: {exc!r}") from exc
        from broker.weights import decode_verified

        return Checkpoint(
            shard=int(shard),
            applied=applied,
            weights=decode_verified(data, sha, len(data), key),
            meta=decode_meta(meta),
            saved_at=saved_at,
        )

    # --- membership ---------------------------------------------------------------------------
    def heartbeat(
        self, job: str, member_id: str, ttl_s: float, info: Mapping[str, str] | None = None
    ) -> None:
        keys.validate_name("member id", member_id)
        args: list[str | int] = [member_id, _ms(ttl_s), "" if info is None else encode_info(info)]
        with _redis_errors("heartbeat"):
            self._scripts.heartbeat(
                keys=[keys.members_key(job), keys.members_info_key(job)], args=args
            )

    def remove_member(self, job: str, member_id: str) -> None:
        with _redis_errors("remove member"):
            pipe = self._redis.pipeline(transaction=True)
            pipe.zrem(keys.members_key(job), member_id)
            pipe.hdel(keys.members_info_key(job), member_id)
            pipe.execute()

    def live_members(self, job: str) -> dict[str, Member]:
        with _redis_errors("live members"):
            flat = self._scripts.live_members(
                keys=[keys.members_key(job), keys.members_info_key(job)]
            )
        members = {}
        for i in range(0, len(flat), 3):
            member_id = _text(flat[i])
            members[member_id] = Member(member_id, float(flat[i + 1]), decode_info(flat[i + 2]))
        return members

    # --- leases -------------------------------------------------------------------------------
    def acquire_lease(self, job: str, name: str, owner: str, ttl_s: float) -> bool:
        keys.validate_name("lease owner", owner)
        with _redis_errors("lease acquire"):
            taken = self._scripts.acquire_lease(
                keys=[keys.lease_key(job, name)], args=[owner, _ms(ttl_s)]
            )
        return bool(taken)

    def release_lease(self, job: str, name: str, owner: str) -> None:
        with _redis_errors("lease release"):
            self._scripts.release_lease(keys=[keys.lease_key(job, name)], args=[owner])

    def lease_owner(self, job: str, name: str) -> str | None:
        with _redis_errors("lease owner"):
            raw = self._redis.get(keys.lease_key(job, name))
        return None if raw is None else _text(raw)

    # --- how the job ended --------------------------------------------------------------------
    def set_job_status(self, job: str, status: JobStatus) -> None:
        key = keys.status_key(job)
        with _redis_errors("set job status"):
            # One MULTI/EXEC: a reader never sees a new state with an old detail.
            pipe = self._redis.pipeline(transaction=True)
            pipe.delete(key)
            pipe.hset(key, mapping={"state": status.state, "detail": status.detail})
            pipe.execute()

    def job_status(self, job: str) -> JobStatus | None:
        key = keys.status_key(job)
        with _redis_errors("job status"):
            fields = _hash(self._redis.hgetall(key))
        if not fields:
            return None
        try:
            return JobStatus(_text(fields[b"state"]), _text(fields.get(b"detail", b"")))
        except (KeyError, ValueError) as exc:
            raise StoreError(f"malformed job status {key}: {exc!r}") from exc

    def clear_job_status(self, job: str) -> None:
        with _redis_errors("clear job status"):
            self._redis.delete(keys.status_key(job))

    # --- operations ---------------------------------------------------------------------------
    def delete_job(self, job: str) -> None:
        pattern = keys.job_pattern(job)
        with _redis_errors("delete job"):
            found = list(self._redis.scan_iter(match=pattern, count=_SCAN_COUNT))
            for i in range(0, len(found), _DELETE_BATCH):
                # UNLINK frees big blobs off the server's main thread.
                self._redis.unlink(*found[i : i + _DELETE_BATCH])

    def server_info(self) -> RedisServerInfo:
        """Version, a write/read probe, persistence and eviction settings, with problems."""
        with _redis_errors("server info"):
            server = self._redis.info("server")
            persistence = self._redis.info("persistence")
            memory = self._redis.info("memory")
            can_write, can_read, probe_problem = self._probe()
            fsync = self._aof_fsync()
        problems = [] if probe_problem is None else [probe_problem]
        aof_enabled = bool(int(persistence.get("aof_enabled", 0)))
        aof_status = str(persistence.get("aof_last_write_status", "unknown"))
        maxmemory = int(memory.get("maxmemory", 0))
        policy = str(memory.get("maxmemory_policy", "unknown"))
        if not aof_enabled:
            problems.append("AOF is off: a Redis crash loses recently published versions")
        elif aof_status != "ok":
            problems.append(f"AOF last write status is {aof_status}")
        elif fsync in ("everysec", "no"):
            problems.append(
                f"appendfsync {fsync}: a crash can lose acknowledged writes (announced versions, "
                "checkpoints whose batches are acked); use appendfsync always"
            )
        if maxmemory and policy != "noeviction":
            problems.append(
                f"maxmemory-policy {policy} may evict weights or leases; use noeviction"
            )
        return RedisServerInfo(
            version=str(server.get("redis_version", "unknown")),
            mode=str(server.get("redis_mode", "unknown")),
            can_write=can_write,
            can_read=can_read,
            aof_enabled=aof_enabled,
            aof_last_write_status=aof_status,
            maxmemory_bytes=maxmemory,
            maxmemory_policy=policy,
            used_memory_bytes=int(memory.get("used_memory", 0)),
            problems=tuple(problems),
            aof_fsync=fsync,
        )

    def _aof_fsync(self) -> str:
        try:
            found: Any = self._redis.config_get("appendfsync")
        except (redis.ConnectionError, redis.TimeoutError):
            raise
        except redis.RedisError:  # CONFIG renamed away or denied by an ACL (managed Redis)
            return "unknown"
        values = {_text(k): _text(v) for k, v in dict(found).items()}
        return values.get("appendfsync", "unknown")

    def _probe(self) -> tuple[bool, bool, str | None]:
        token = uuid.uuid4().hex
        key = keys.probe_key(token)
        try:
            self._redis.set(key, token, px=10_000)
        except (redis.ConnectionError, redis.TimeoutError):
            raise
        except redis.RedisError as exc:  # e.g. READONLY replica, MISCONF, OOM
            return False, False, f"probe write failed: {exc}"
        try:
            value: Any = self._redis.get(key)
            self._redis.delete(key)
        except (redis.ConnectionError, redis.TimeoutError):
            raise
        except redis.RedisError as exc:
            return True, False, f"probe read failed: {exc}"
        if value != token.encode():
            return True, False, "probe read returned a different value"
        return True, True, None

    def close(self) -> None:
        self._redis.close()
