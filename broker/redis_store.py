"""`RedisWeightStore`: the `WeightStore` over Redis (redis-py), key schema in `broker.keys`.

Every multi-key step that must be atomic is one Lua script (`broker.redis_scripts`) or one
MULTI/EXEC. redis errors never escape: connection problems become `StoreUnavailableError`, the
rest `StoreError`. Every operation goes through `_call`, which rides out an outage, so every
step must be idempotent: docs/reliability.md, "Redis restart", says how each one is.

With `RedisStoreOptions.sentinels` the store follows the primary that Redis Sentinel names and
rides out a failover the same way (docs/reliability.md, "Redis with Sentinel"); with
`min_replicas` a version commit or checkpoint save returns only once that many replicas have
it (WAIT).
"""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import redis
from redis.backoff import ExponentialBackoff, NoBackoff
from redis.connection import parse_url
from redis.retry import Retry
from redis.sentinel import Sentinel

from broker import keys, redis_scripts
from broker.errors import (
    StoreAuthError,
    StoreError,
    StoreUnavailableError,
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
from broker.tls import TLSOptions, redis_ssl_kwargs, wants_tls

if TYPE_CHECKING:
    import torch

T = TypeVar("T")
_SCAN_COUNT = 500
_DELETE_BATCH = 500


@dataclass(frozen=True)
class RetryPolicy:
    # How long one call waits for the store before the error reaches the caller (0: never wait).
    retry_for_s: float = 120.0
    first_backoff_s: float = 0.1
    max_backoff_s: float = 2.0

    def __post_init__(self) -> None:
        if self.retry_for_s < 0:
            raise ValueError(f"retry_for_s must be >= 0, got {self.retry_for_s}")
        if not 0 < self.first_backoff_s <= self.max_backoff_s:
            raise ValueError("backoffs must satisfy 0 < first_backoff_s <= max_backoff_s")


NO_RETRY = RetryPolicy(retry_for_s=0.0)


@dataclass(frozen=True)
class RedisStoreOptions:
    # Generous read timeout: one blob can be tens of MB over a slow link.
    socket_timeout_s: float = 30.0
    socket_connect_timeout_s: float = 5.0
    # Retries of a command after a connection error or timeout (every step is idempotent).
    retries: int = 2
    keep_versions: int = 5
    # How long an uncommitted blob lives: long enough for a slow publisher to commit.
    pending_ttl_s: float = 600.0
    # TLS for rediss:// URLs (None: system CAs, hostname checked); refused with redis://.
    tls: TLSOptions | None = None
    # How long an operation waits out an outage (roles); probes and health checks fail at once.
    retry: RetryPolicy = field(default=NO_RETRY)
    # Redis Sentinel: (host, port) of each sentinel; empty: the URL's host is the server.
    sentinels: tuple[tuple[str, int], ...] = ()
    master_name: str = "splitmq"
    # Replicas that must acknowledge a version commit or a checkpoint save (WAIT), and for how
    # long one WAIT may block; fewer acks count as an outage (retried, then unavailable).
    min_replicas: int = 0
    replica_timeout_s: float = 2.0

    def __post_init__(self) -> None:
        if self.keep_versions < 1:
            raise ValueError(f"keep_versions must be >= 1, got {self.keep_versions}")
        if not self.pending_ttl_s > 0:
            raise ValueError(f"pending_ttl_s must be positive, got {self.pending_ttl_s}")
        if self.min_replicas < 0:
            raise ValueError(f"min_replicas must be >= 0, got {self.min_replicas}")
        if not self.replica_timeout_s > 0 or (
            self.min_replicas and self.replica_timeout_s >= self.socket_timeout_s
        ):
            raise ValueError(
                f"replica_timeout_s must be positive and below socket_timeout_s (WAIT holds "
                f"the socket), got {self.replica_timeout_s} and {self.socket_timeout_s}"
            )


@dataclass(frozen=True)
class RedisServerInfo:
    """What `splitmq doctor` reports about the Redis behind the store."""

    version: str
    can_write: bool
    can_read: bool
    aof_enabled: bool
    problems: tuple[str, ...]
    # appendfsync ("always", "everysec", "no"; "unknown" where CONFIG is not allowed).
    aof_fsync: str = "unknown"
    # The primary's address, and its replicas as "host:port" (online, lag N s) from its INFO.
    primary: str = ""
    replicas: tuple[str, ...] = ()
    # With Sentinel: each sentinel as "host:port" with what it says ("ok", or the error).
    sentinels: tuple[str, ...] = ()


class _NotReplicated(Exception):
    """WAIT came back with fewer replicas than `min_replicas`: waited out like an outage."""


# Replies a primary gives while Sentinel moves the role (a demoted primary refusing writes,
# min-replicas-to-write refusing them while replicas reconnect, a WAIT cut short by the
# demotion, a replica whose link to the primary is down): with Sentinel, transient.
_FAILOVER_REPLIES = ("READONLY", "NOREPLICAS", "UNBLOCKED", "MASTERDOWN")


_BLOB_FIELD = keys.BLOB_FIELD_PREFIX.encode()


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
    return max(1, round(positive_ttl(ttl_s) * 1000))


def encode_entry(blob: PreparedBlob) -> str:
    e = blob.entry
    return json.dumps(
        {
            "part": e.ref.part,
            "owner": e.ref.owner,
            "key": blob.key,
            "sha256": e.sha256,
            "nbytes": e.nbytes,
            "samples": e.samples,
        },
        sort_keys=True,
    )


def decode_entry(raw: bytes | str) -> tuple[str, ManifestEntry]:
    """(blob key, entry) of one manifest field; `StoreError` if the field is malformed."""
    try:
        obj = json.loads(raw)
        ref = BlobRef(str(obj["part"]), str(obj["owner"]))
        entry = ManifestEntry(ref, str(obj["sha256"]), int(obj["nbytes"]), int(obj["samples"]))
        return str(obj["key"]), entry
    except (ValueError, KeyError, TypeError) as exc:
        raise StoreError(f"malformed manifest entry {raw!r}: {exc}") from exc


def encode_info(info: Mapping[str, str]) -> str:
    return json.dumps(str_map("member info", info), sort_keys=True)


def decode_info(raw: bytes | str) -> dict[str, str]:
    try:
        obj = json.loads(raw)
    except ValueError as exc:
        raise StoreError(f"malformed member info {raw!r}: {exc}") from exc
    if not isinstance(obj, dict):
        raise StoreError(f"malformed member info {raw!r}")
    return {str(k): str(v) for k, v in obj.items()}


def _kind_keys(job: str, kind: MemberKind) -> list[str]:
    return [keys.members_key(job, kind), keys.members_info_key(job, kind)]


def kind_slots(job: str, member_ids: Sequence[str]) -> tuple[list[str], list[str | int]]:
    """The KEYS and the (slot, member) ARGV pairs of a script over `member_ids` of any kinds
    (redis_scripts.RENEW_MEMBERS): each kind's pair of keys once, in the order first met."""
    slots: dict[MemberKind, int] = {}
    script_keys: list[str] = []
    args: list[str | int] = []
    for member_id in member_ids:
        kind = keys.member_kind(member_id)
        if kind not in slots:
            slots[kind] = len(slots) + 1
            script_keys += _kind_keys(job, kind)
        args += [slots[kind], member_id]
    return script_keys, args


class RedisWeightStore(PublishingStore):
    """Thread-safe (redis-py's connection pool); one instance per process is enough."""

    def __init__(
        self,
        url: str,
        options: RedisStoreOptions | None = None,
        *,
        logger: logging.Logger | None = None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self._options = opts = options or RedisStoreOptions()
        tls: dict[str, Any] = {}
        if wants_tls(url, "redis", "Redis", "store.redis_url, SPLITMQ_REDIS_URL", opts.tls):
            tls = redis_ssl_kwargs(opts.tls or TLSOptions())
        common: dict[str, Any] = {
            "socket_timeout": opts.socket_timeout_s,
            "socket_connect_timeout": opts.socket_connect_timeout_s,
            # PINGs idle pooled connections every 30 s, so a dead one is noticed before use.
            "health_check_interval": 30,
            "retry": Retry(ExponentialBackoff(cap=1.0, base=0.05), opts.retries),
            "client_name": "splitmq-store",
            "decode_responses": False,
        }
        # No connection is opened here: the first command connects.
        self._sentinel: Sentinel | None = None
        if opts.sentinels:
            self._sentinel, self._redis = _via_sentinel(url, opts, common, tls)
        else:
            self._redis = redis.Redis.from_url(url, **common, **tls)
        script = self._redis.register_script  # binds; no server round trip until first use
        self._publish = script(redis_scripts.PUBLISH)
        self._discard = script(redis_scripts.DISCARD_PENDING)
        self._save_checkpoint = script(redis_scripts.SAVE_CHECKPOINT)
        self._heartbeat = script(redis_scripts.HEARTBEAT)
        self._live_members = script(redis_scripts.LIVE_MEMBERS)
        self._renew_members = script(redis_scripts.RENEW_MEMBERS)
        self._member_ttls = script(redis_scripts.MEMBER_TTLS)
        self._member = script(redis_scripts.MEMBER)
        self._acquire_lease = script(redis_scripts.ACQUIRE_LEASE)
        self._release_lease = script(redis_scripts.RELEASE_LEASE)
        self._log = logger or logging.getLogger("splitmq.store")
        self._clock = clock
        self._sleep = sleep
        self._lock = threading.Lock()  # the outage state is shared by all threads
        self._down_since: float | None = None
        # The blobs this thread's publish wrote (`_write_pending`), for `_commit` to write again
        # if a failover lost them before the commit (publish_version runs both on one thread).
        self._pending = threading.local()

    # --- the one way to Redis: errors translated, outages waited out -------------------------
    def _call(self, what: str, op: Callable[[], T]) -> T:
        policy = self._options.retry
        first_failure: float | None = None
        delay = policy.first_backoff_s
        while True:
            try:
                result = op()
            except redis.AuthenticationError as exc:  # a ConnectionError to redis-py: no retry
                raise StoreAuthError(
                    f"Redis refused the credentials of store.redis_url during {what}: {exc}"
                ) from exc
            except (redis.ConnectionError, redis.TimeoutError, _NotReplicated) as exc:
                failure: Exception = exc
            except redis.RedisError as exc:
                if not self._failing_over(exc):
                    raise StoreError(f"redis error during {what}: {exc}") from exc
                failure = exc
            else:
                self._came_back()
                return result
            if isinstance(failure, _NotReplicated):
                down = StoreUnavailableError(f"{what} not replicated: {failure}")
            else:
                down = StoreUnavailableError(f"redis unreachable during {what}: {failure}")
            if policy.retry_for_s == 0:
                raise down from failure
            now = self._clock()
            self._went_down(what, down, now)
            first_failure = now if first_failure is None else first_failure
            left = policy.retry_for_s - (now - first_failure)
            if left <= 0:
                self._log.error(
                    "store still unavailable after %.1f s (%s): giving up",
                    now - first_failure,
                    what,
                )
                raise down from failure
            self._sleep(min(delay, left))
            delay = min(delay * 2, policy.max_backoff_s)

    def _failing_over(self, exc: redis.RedisError) -> bool:
        """A reply that, behind Sentinel, means the primary is changing (a single server
        answering so is misconfigured, and keeps today's immediate StoreError). NOSCRIPT is
        one: a pipeline loads its scripts on the old primary, then runs EVALSHA on the promoted
        replica, which has never seen them; the retry's pipeline loads them there."""
        if self._sentinel is None or not isinstance(exc, redis.ResponseError):
            return False
        return str(exc).startswith(_FAILOVER_REPLIES) or isinstance(
            exc, redis.ReadOnlyError | redis.exceptions.NoScriptError
        )

    def _replicated(
        self,
        script: Any,
        script_keys: Sequence[str],
        args: Sequence[Any],
        what: str,
        landed: Callable[[Any], bool],
    ) -> Any:
        """Run `script`; with store.min_replicas, WAIT behind it in the same round trip (WAIT
        counts the acks of its own connection's writes, so it must travel on the write's
        connection). A write that `landed` on fewer replicas raises `_NotReplicated`, an
        outage `_call` retries: both scripts are idempotent."""
        need, timeout = self._options.min_replicas, self._options.replica_timeout_s
        if not need:
            return script(keys=script_keys, args=args)
        pipe = self._redis.pipeline(transaction=False)
        script(keys=script_keys, args=args, client=pipe)
        pipe.wait(need, _ms(timeout))
        result, acked = pipe.execute()
        if int(acked) < need and landed(result):
            raise _NotReplicated(
                f"{what} acknowledged by {acked} of store.min_replicas = {need} replicas "
                f"within {timeout:g} s"
            )
        return result

    def _went_down(self, what: str, exc: StoreUnavailableError, now: float) -> None:
        with self._lock:
            if self._down_since is not None:
                return
            self._down_since = now
        self._log.warning(
            "store unavailable (%s: %s): waiting for Redis up to %.0f s",
            what,
            exc,
            self._options.retry.retry_for_s,
        )

    def _came_back(self) -> None:
        with self._lock:
            if self._down_since is None:
                return
            down_s = self._clock() - self._down_since
            self._down_since = None
        self._log.warning("store back after %.1f s", down_s)

    # --- versions -----------------------------------------------------------------------------
    def current_version(self, job: str) -> int:
        raw = self._call("current_version", lambda: self._redis.get(keys.version_key(job)))
        return NO_VERSION if raw is None else int(raw)

    def _write_pending(self, job: str, blobs: Sequence[PreparedBlob]) -> list[str]:
        self._pending.created = set()
        if not blobs:
            return []
        ttl_ms = _ms(self._options.pending_ttl_s)

        def write() -> list[Any]:
            # NX: an identical blob (same content, same version) may already be committed by a
            # racing publisher; overwriting it would put a pending expiry back on a live blob.
            pipe = self._redis.pipeline(transaction=False)
            for blob in blobs:
                pipe.set(blob.key, blob.data, px=ttl_ms, nx=True)
            return pipe.execute()

        results = self._call("publish_version", write)
        created = [blob.key for blob, made in zip(blobs, results, strict=True) if made]
        self._pending.created = set(created)
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
        script_keys = [
            keys.version_key(job),
            keys.versions_key(job),
            keys.manifest_key(job, version),
            *(blob.key for blob in blobs),
        ]
        args: list[str | int] = [expected, commit_id, json.dumps(dict(meta), sort_keys=True)]
        for blob in blobs:
            args += [keys.blob_field(blob.entry.ref), encode_entry(blob)]

        def commit() -> Any:
            # Retried when short of replicas: the script finds its manifest by the commit id.
            what = f"version {version} of job {job}"
            return self._replicated(
                self._publish, script_keys, args, what, lambda reply: _text(reply[0]) == "ok"
            )

        created: set[str] = getattr(self._pending, "created", set())
        for _ in range(len(blobs) + 1):
            reply = self._call("publish_version", commit)
            status, detail = _text(reply[0]), _text(reply[1])
            if status != "missing" or detail not in created:
                break
            # A blob this publish wrote is gone: the primary that took it died before
            # replicating it, and the promoted replica never had it. Content-addressed, so
            # writing it again is safe; a blob it never wrote stays a torn write.
            self._log.warning(
                "job %s: blob %s vanished before the commit of version %d (a failover?): "
                "writing it again",
                job,
                detail,
                version,
            )
            created |= set(self._write_pending(job, blobs))
        return status, detail

    def _discard_pending(self, job: str, blob_keys: Sequence[str]) -> None:
        if blob_keys:
            self._call("publish_version", lambda: self._discard(keys=list(blob_keys)))

    def _apply_retention(self, job: str) -> None:
        def drop_old() -> None:
            newest_dropped = -(self._options.keep_versions + 1)
            for raw in self._redis.zrange(keys.versions_key(job), 0, newest_dropped):
                # One version whole: index entry, manifest and blobs in one MULTI/EXEC.
                version = int(_as_bytes(raw))
                manifest_key = keys.manifest_key(job, version)
                fields = _hash(self._redis.hgetall(manifest_key))
                blobs = [decode_entry(v)[0] for k, v in fields.items() if k.startswith(_BLOB_FIELD)]
                pipe = self._redis.pipeline(transaction=True)
                pipe.zrem(keys.versions_key(job), str(version))
                pipe.unlink(manifest_key, *blobs)
                pipe.execute()

        self._call("retention", drop_old)

    def manifest(self, job: str, version: int) -> Manifest:
        key = keys.manifest_key(job, version)
        fields = _hash(self._call("manifest", lambda: self._redis.hgetall(key)))
        if not fields:
            raise VersionNotFoundError(f"job {job}: version {version} is not retained")
        entries = [decode_entry(v)[1] for k, v in fields.items() if k.startswith(_BLOB_FIELD)]
        try:
            meta = json.loads(fields.get(b"meta", b"{}"))
            created_at = float(fields.get(b"created_at", b"0"))
        except ValueError as exc:
            raise StoreError(f"job {job}: malformed manifest of version {version}: {exc}") from exc
        meta = {str(k): str(v) for k, v in meta.items()}
        return Manifest(version, {e.ref: e for e in entries}, created_at, meta)

    def read_blob(self, job: str, version: int, ref: BlobRef) -> dict[str, torch.Tensor]:
        manifest_key = keys.manifest_key(job, version)

        def read() -> tuple[str, ManifestEntry, Any]:
            pipe = self._redis.pipeline(transaction=False)
            pipe.exists(manifest_key)
            pipe.hget(manifest_key, keys.blob_field(ref))
            exists, raw_entry = pipe.execute()
            if not exists:
                raise VersionNotFoundError(f"job {job}: version {version} is not retained")
            if raw_entry is None:
                raise StoreError(f"job {job}: version {version} has no blob {ref.name}")
            key, entry = decode_entry(raw_entry)
            return key, entry, self._redis.get(key)

        key, entry, data = self._call("read_blob", read)
        return decode_blob(job, version, key, entry, None if data is None else _as_bytes(data))

    def versions(self, job: str) -> list[int]:
        raw = self._call("versions", lambda: self._redis.zrange(keys.versions_key(job), 0, -1))
        return [int(_as_bytes(v)) for v in raw]

    # --- shard checkpoints --------------------------------------------------------------------
    def save_checkpoint(
        self, job: str, checkpoint: Checkpoint, *, holder: tuple[str, str] | None = None
    ) -> None:
        data, sha256, meta = encode_checkpoint(checkpoint)
        args: list[bytes | str | int] = [data, sha256, int(checkpoint.applied), meta]
        script_keys = [keys.checkpoint_key(job, checkpoint.shard)]
        if holder is not None:
            script_keys.append(keys.lease_key(job, holder[0]))
            args.append(holder[1])

        def save() -> Any:
            # A replace, so retried when short of replicas; with `holder` the script itself
            # refuses a writer that lost the lease (during an outage, say).
            what = f"checkpoint of shard {checkpoint.shard} of job {job}"
            return self._replicated(
                self._save_checkpoint, script_keys, args, what, lambda result: result != -1
            )

        saved = self._call("save_checkpoint", save)
        if holder is not None and saved == -1:  # the script returns -1 (an integer) or a time
            raise lease_not_held(checkpoint.shard, holder)

    def load_checkpoint(self, job: str, shard: int) -> Checkpoint | None:
        key = keys.checkpoint_key(job, shard)
        fields = _hash(self._call("load_checkpoint", lambda: self._redis.hgetall(key)))
        if not fields:
            return None
        try:
            data, sha, meta = fields[b"weights"], _text(fields[b"sha256"]), fields[b"meta"]
            applied, saved_at = int(fields[b"applied"]), float(fields[b"saved_at"])
        except (KeyError, ValueError) as exc:
            raise StoreError(f"malformed checkpoint {key}: {exc!r}") from exc
        return decode_checkpoint(key, shard, applied, data, sha, meta, saved_at)

    # --- membership ---------------------------------------------------------------------------
    def heartbeat(
        self, job: str, member_id: str, ttl_s: float, info: Mapping[str, str] | None = None
    ) -> None:
        keys.validate_name("member id", member_id)
        args: list[str | int] = [member_id, _ms(ttl_s), "" if info is None else encode_info(info)]
        script_keys = _kind_keys(job, keys.member_kind(member_id))
        self._call("heartbeat", lambda: self._heartbeat(keys=script_keys, args=args))

    def renew_members(self, job: str, member_ids: Sequence[str], ttl_s: float) -> list[bool]:
        if not member_ids:
            return []
        script_keys, slots = kind_slots(job, member_ids)
        args: list[str | int] = [_ms(ttl_s), *slots]
        # Idempotent on a retry: a renewal renews again; one pruned by the first try was dead.
        live = self._call("renew_members", lambda: self._renew_members(keys=script_keys, args=args))
        return [bool(flag) for flag in live]

    def member(self, job: str, member_id: str) -> Member | None:
        script_keys = _kind_keys(job, keys.member_kind(member_id))
        found = self._call("member", lambda: self._member(keys=script_keys, args=[member_id]))
        if not found:
            return None
        return Member(member_id, float(found[0]), decode_info(found[1]))

    def remove_member(self, job: str, member_id: str) -> None:
        zset, info = _kind_keys(job, keys.member_kind(member_id))

        def remove() -> None:
            # Built anew on every try: a failed `execute` empties the pipeline.
            pipe = self._redis.pipeline(transaction=True)
            pipe.zrem(zset, member_id)
            pipe.hdel(info, member_id)
            pipe.execute()

        self._call("remove_member", remove)

    def live_members(self, job: str, kind: MemberKind | None = None) -> dict[str, Member]:
        kinds = list(MemberKind) if kind is None else [kind]
        script_keys = [key for k in kinds for key in _kind_keys(job, k)]
        flat = self._call("live_members", lambda: self._live_members(keys=script_keys))
        members = {}
        for i in range(0, len(flat), 3):
            member_id = _text(flat[i])
            members[member_id] = Member(member_id, float(flat[i + 1]), decode_info(flat[i + 2]))
        return members

    def member_ttls(self, job: str, member_ids: Sequence[str]) -> list[float | None]:
        if not member_ids:
            return []
        script_keys, args = kind_slots(job, member_ids)
        # Idempotent on a retry: one pruned by the first try reads as gone again.
        left = self._call("member_ttls", lambda: self._member_ttls(keys=script_keys, args=args))
        return [float(ttl) if ttl else None for ttl in left]

    # --- leases -------------------------------------------------------------------------------
    def acquire_lease(self, job: str, name: str, owner: str, ttl_s: float) -> bool:
        keys.validate_name("lease owner", owner)
        key, ttl_ms = keys.lease_key(job, name), _ms(ttl_s)
        taken = self._call(
            "acquire_lease", lambda: self._acquire_lease(keys=[key], args=[owner, ttl_ms])
        )
        return bool(taken)

    def release_lease(self, job: str, name: str, owner: str) -> None:
        key = keys.lease_key(job, name)
        self._call("release_lease", lambda: self._release_lease(keys=[key], args=[owner]))

    # --- how the job ended --------------------------------------------------------------------
    def set_job_status(self, job: str, status: JobStatus) -> None:
        key = keys.status_key(job)

        def replace() -> None:
            # One MULTI/EXEC: a reader never sees a new state with an old detail.
            pipe = self._redis.pipeline(transaction=True)
            pipe.delete(key)
            pipe.hset(key, mapping={"state": status.state, "detail": status.detail})
            pipe.execute()

        self._call("set_job_status", replace)

    def job_status(self, job: str) -> JobStatus | None:
        key = keys.status_key(job)
        fields = _hash(self._call("job_status", lambda: self._redis.hgetall(key)))
        if not fields:
            return None
        try:
            return JobStatus(_text(fields[b"state"]), _text(fields.get(b"detail", b"")))
        except (KeyError, ValueError) as exc:
            raise StoreError(f"malformed job status {key}: {exc!r}") from exc

    def clear_job_status(self, job: str) -> None:
        key = keys.status_key(job)
        self._call("clear_job_status", lambda: self._redis.delete(key))

    # --- operations ---------------------------------------------------------------------------
    def delete_job(self, job: str) -> None:
        pattern = keys.job_pattern(job)

        def delete() -> None:
            found = list(self._redis.scan_iter(match=pattern, count=_SCAN_COUNT))
            for i in range(0, len(found), _DELETE_BATCH):
                # UNLINK frees big blobs off the server's main thread.
                self._redis.unlink(*found[i : i + _DELETE_BATCH])

        self._call("delete_job", delete)

    def server_info(self) -> RedisServerInfo:
        """Version, a write/read probe, persistence and eviction settings, with problems."""
        return self._call("server_info", self._server_info)

    def _server_info(self) -> RedisServerInfo:
        info: Any = self._redis.info
        server, persistence, memory = info("server"), info("persistence"), info("memory")
        can_write, can_read, probe_problem = self._probe()
        try:
            found: Any = self._redis.config_get("appendfsync")
        except redis.ResponseError:  # CONFIG renamed away or denied by an ACL (managed Redis)
            found = {}
        fsync = {_text(k): _text(v) for k, v in dict(found).items()}.get("appendfsync", "unknown")
        problems = [] if probe_problem is None else [probe_problem]
        aof_enabled = bool(int(persistence.get("aof_enabled", 0)))
        aof_status = str(persistence.get("aof_last_write_status", "unknown"))
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
        if int(memory.get("maxmemory", 0)) and policy != "noeviction":
            problems.append(
                f"maxmemory-policy {policy} may evict weights or leases; use noeviction"
            )
        primary, replicas = self._replication(info("replication"), problems)
        sentinels = self._sentinels(primary, problems)
        version = str(server.get("redis_version", "unknown"))
        return RedisServerInfo(
            version,
            can_write,
            can_read,
            aof_enabled,
            tuple(problems),
            fsync,
            primary,
            replicas,
            sentinels,
        )

    def _replication(
        self, replication: Mapping[str, Any], problems: list[str]
    ) -> tuple[str, tuple[str, ...]]:
        """The address this client writes to and its replicas from INFO replication."""
        kwargs = self._redis.connection_pool.connection_kwargs
        address = getattr(self._redis.connection_pool, "master_address", None)
        host, port = address or (kwargs.get("host"), kwargs.get("port"))
        replicas, online = [], 0
        for i in range(int(replication.get("connected_slaves", 0))):
            r = replication.get(f"slave{i}", {})
            online += r.get("state") == "online"
            replicas.append(
                f"{r.get('ip')}:{r.get('port')} ({r.get('state')}, lag {r.get('lag')} s)"
            )
        role = str(replication.get("role", "unknown")).replace("slave", "replica")
        if role != "master":
            problems.append(f"{host}:{port} is a {role}, not the primary: writes will fail")
        need = self._options.min_replicas
        if online < need:
            problems.append(
                f"store.min_replicas = {need} but the primary has {online} replicas online: "
                "version publishes and checkpoints wait for replicas, then fail"
            )
        elif self._sentinel is not None and not online:
            problems.append("no replica online: Sentinel has nothing to promote")
        return f"{host}:{port}", tuple(replicas)

    def _sentinels(self, primary: str, problems: list[str]) -> tuple[str, ...]:
        """What each sentinel says of `master_name`; problems for those that disagree."""
        if self._sentinel is None:
            return ()
        name, found = self._options.master_name, []
        for client in self._sentinel.sentinels:
            kwargs = client.connection_pool.connection_kwargs
            where = f"{kwargs.get('host')}:{kwargs.get('port')}"
            try:
                state: Any = client.sentinel_master(name)
            except redis.RedisError as exc:
                found.append(f"{where} failed: {exc}")
                problems.append(f"sentinel {where} does not answer for {name!r}: {exc}")
                continue
            says = f"{state.get('ip')}:{state.get('port')}"
            found.append(
                f"{where} ok (primary {says}, quorum {state.get('quorum')}, "
                f"{state.get('num-other-sentinels')} other sentinels)"
            )
            if says != primary:
                problems.append(f"sentinel {where} names {says} as the primary, not {primary}")
        if len(found) < 3:
            problems.append(
                f"{len(found)} sentinels: a failover needs a majority, so one lost sentinel "
                "can block it (run three or more)"
            )
        return tuple(found)

    def _probe(self) -> tuple[bool, bool, str | None]:
        """(can write, can read, problem) of a scratch key written, read back and deleted."""
        token = uuid.uuid4().hex
        key = keys.probe_key(token)
        wrote = False
        try:
            self._redis.set(key, token, px=10_000)
            wrote = True
            value: Any = self._redis.get(key)
            self._redis.delete(key)
        except redis.ResponseError as exc:  # e.g. READONLY replica, MISCONF, OOM
            return wrote, False, f"probe {'read' if wrote else 'write'} failed: {exc}"
        if value != token.encode():
            return True, False, "probe read returned a different value"
        return True, True, None

    def close(self) -> None:
        self._redis.close()
        if self._sentinel is not None:
            self._sentinel.close()


def _via_sentinel(
    url: str, opts: RedisStoreOptions, common: Mapping[str, Any], tls: Mapping[str, Any]
) -> tuple[Sentinel, redis.Redis]:
    """The Sentinel client and a client of the primary it names. The URL gives the db, the
    credentials and TLS (rediss://); its host and port are not used."""
    params = {
        k: v
        for k, v in parse_url(url).items()  # type: ignore[no-untyped-call, unused-ignore]
        if k not in ("host", "port", "connection_class")
    }
    ssl: dict[str, Any] = {"ssl": True, **tls} if tls else {}
    sentinel = Sentinel(  # type: ignore[no-untyped-call, unused-ignore]
        list(opts.sentinels),
        # Sentinels answer small queries: a dead one must not hold up discovery for long. They
        # get TLS like the data nodes, no credentials (sentinels with requirepass: not yet).
        sentinel_kwargs={
            "socket_timeout": opts.socket_connect_timeout_s,
            "socket_connect_timeout": opts.socket_connect_timeout_s,
            # Discovery moves on to the next sentinel; `_call` backs off between rounds.
            "retry": Retry(NoBackoff(), 0),
            **ssl,
        },
    )
    client: redis.Redis = sentinel.master_for(  # type: ignore[no-untyped-call, unused-ignore]
        opts.master_name, redis_class=redis.Redis, **common, **params, **ssl
    )
    return sentinel, client
