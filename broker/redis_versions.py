"""`RedisVersions`: the `VersionStore` over Redis, key schema in `broker.keys`.

A version is committed by one Lua script (`redis_scripts.PUBLISH`), a compare-and-set of the
current version that also writes its manifest and makes its blobs permanent; a version dropped
by retention goes whole in one MULTI/EXEC. `PublishingStore.publish_version` says how the steps
fit together.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from broker import keys, redis_scripts
from broker.errors import StoreError, VersionNotFoundError
from broker.redis_connection import (
    RedisConnection,
    RedisPart,
    as_bytes,
    as_text,
    byte_hash,
    millis,
)
from broker.store import NO_VERSION, BlobRef, Manifest, ManifestEntry
from broker.store_codec import PreparedBlob, PublishingStore, decode_blob

if TYPE_CHECKING:
    import torch

_BLOB_FIELD = keys.BLOB_FIELD_PREFIX.encode()


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


class RedisVersions(RedisPart, PublishingStore):
    """Published versions of a job's weights: blobs, manifests, the current version."""

    def __init__(self, db: RedisConnection) -> None:
        super().__init__(db)
        self._publish = db.script(redis_scripts.PUBLISH)
        self._discard = db.script(redis_scripts.DISCARD_PENDING)
        # The blobs this thread's publish wrote (`_write_pending`), for `_commit` to write again
        # if a failover lost them before the commit (publish_version runs both on one thread).
        self._pending = threading.local()

    def current_version(self, job: str) -> int:
        raw = self._db.call("current_version", lambda: self._db.client.get(keys.version_key(job)))
        return NO_VERSION if raw is None else int(raw)

    def _write_pending(self, job: str, blobs: Sequence[PreparedBlob]) -> list[str]:
        self._pending.created = set()
        if not blobs:
            return []
        ttl_ms = millis(self._db.options.pending_ttl_s)

        def write() -> list[Any]:
            # NX: an identical blob (same content, same version) may already be committed by a
            # racing publisher; overwriting it would put a pending expiry back on a live blob.
            pipe = self._db.client.pipeline(transaction=False)
            for blob in blobs:
                pipe.set(blob.key, blob.data, px=ttl_ms, nx=True)
            return pipe.execute()

        results = self._db.call("publish_version", write)
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
            return self._db.replicated(
                self._publish, script_keys, args, what, lambda reply: as_text(reply[0]) == "ok"
            )

        created: set[str] = getattr(self._pending, "created", set())
        for _ in range(len(blobs) + 1):
            reply = self._db.call("publish_version", commit)
            status, detail = as_text(reply[0]), as_text(reply[1])
            if status != "missing" or detail not in created:
                break
            # A blob this publish wrote is gone: the primary that took it died before
            # replicating it, and the promoted replica never had it. Content-addressed, so
            # writing it again is safe; a blob it never wrote stays a torn write.
            self._db.log.warning(
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
            self._db.call("publish_version", lambda: self._discard(keys=list(blob_keys)))

    def _apply_retention(self, job: str) -> None:
        client = self._db.client

        def drop_old() -> None:
            newest_dropped = -(self._db.options.keep_versions + 1)
            for raw in client.zrange(keys.versions_key(job), 0, newest_dropped):
                # One version whole: index entry, manifest and blobs in one MULTI/EXEC.
                version = int(as_bytes(raw))
                manifest_key = keys.manifest_key(job, version)
                fields = byte_hash(client.hgetall(manifest_key))
                blobs = [decode_entry(v)[0] for k, v in fields.items() if k.startswith(_BLOB_FIELD)]
                pipe = client.pipeline(transaction=True)
                pipe.zrem(keys.versions_key(job), str(version))
                pipe.unlink(manifest_key, *blobs)
                pipe.execute()

        self._db.call("retention", drop_old)

    def manifest(self, job: str, version: int) -> Manifest:
        key = keys.manifest_key(job, version)
        fields = byte_hash(self._db.call("manifest", lambda: self._db.client.hgetall(key)))
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
        client = self._db.client

        def read() -> tuple[str, ManifestEntry, Any]:
            pipe = client.pipeline(transaction=False)
            pipe.exists(manifest_key)
            pipe.hget(manifest_key, keys.blob_field(ref))
            exists, raw_entry = pipe.execute()
            if not exists:
                raise VersionNotFoundError(f"job {job}: version {version} is not retained")
            if raw_entry is None:
                raise StoreError(f"job {job}: version {version} has no blob {ref.name}")
            key, entry = decode_entry(raw_entry)
            return key, entry, client.get(key)

        key, entry, data = self._db.call("read_blob", read)
        return decode_blob(job, version, key, entry, None if data is None else as_bytes(data))

    def versions(self, job: str) -> list[int]:
        versions_key = keys.versions_key(job)
        raw = self._db.call("versions", lambda: self._db.client.zrange(versions_key, 0, -1))
        return [int(as_bytes(v)) for v in raw]
