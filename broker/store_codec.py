"""What both weight stores share: the publish protocol, and the bytes they hold.

Both stores hold the same bytes (safetensors blobs, msgpack checkpoint metadata) under the same
keys, so they validate, copy and fail identically; the in-memory store stands in for Redis.
`PublishingStore.publish_version` runs the four steps of docs/architecture.md, "Weights and
versions", each store supplying the storage; the steps are methods so tests can inject a crash
between blob writes.
"""

from __future__ import annotations

import contextlib
import logging
import uuid
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import msgpack

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
from broker.store import NO_VERSION, BlobRef, Checkpoint, ManifestEntry, Weights

# Where the optimizer state of a checkpoint sits in its safetensors blob, beside the weights
# (a model with a top-level module called "optim" could not be checkpointed: refused).
OPTIMIZER_PREFIX = "optim."

# `broker.weights` (torch) is imported inside the functions that move weights: why in broker.store.
if TYPE_CHECKING:
    import torch

_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PreparedBlob:
    """One serialised blob of a version about to be published."""

    key: str
    data: bytes
    entry: ManifestEntry


def prepare_blobs(
    job: str,
    version: int,
    blobs: Mapping[BlobRef, Weights],
    samples: Mapping[BlobRef, int] | None,
) -> list[PreparedBlob]:
    """Serialise and hash every blob (the CPU-heavy part, done before touching the store)."""
    from broker.weights import encode_weights, sha256_hex

    samples = dict(samples or {})
    unknown = set(samples) - set(blobs)
    if unknown:
        raise ValueError(f"samples name blobs that are not published: {sorted(unknown)}")
    prepared = []
    for ref in sorted(blobs):
        keys.validate_ref(ref)
        count = samples.get(ref, 0)
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise ValueError(
                f"sample count of {ref.name} must be a non-negative int, got {count!r}"
            )
        data = encode_weights(blobs[ref])
        digest = sha256_hex(data)
        entry = ManifestEntry(ref=ref, sha256=digest, nbytes=len(data), samples=count)
        prepared.append(PreparedBlob(keys.blob_key(job, ref, version, digest), data, entry))
    return prepared


def positive_ttl(ttl_s: float) -> float:
    if not ttl_s > 0:
        raise ValueError(f"ttl must be positive, got {ttl_s!r}")
    return float(ttl_s)


def str_map(what: str, mapping: Mapping[str, str] | None) -> dict[str, str]:
    """A copy of `mapping` (manifest meta, member info), checked to map str to str."""
    result = dict(mapping or {})
    for k, v in result.items():
        if not isinstance(k, str) or not isinstance(v, str):
            raise ValueError(f"{what} must map str to str, got {k!r}: {v!r}")
    return result


def decode_blob(
    job: str, version: int, key: str, entry: ManifestEntry, data: bytes | None
) -> dict[str, torch.Tensor]:
    """The blob `key` of a version as read (None: gone), verified against its manifest entry."""
    if data is None:
        # Retention removed the version between the manifest read and this one.
        raise VersionNotFoundError(f"job {job}: blob {key} of version {version} is gone")
    from broker.weights import decode_verified

    return decode_verified(data, entry.sha256, entry.nbytes, key)


def encode_checkpoint(checkpoint: Checkpoint) -> tuple[bytes, str, bytes]:
    """(safetensors bytes, their sha256, msgpack meta) of a checkpoint about to be saved (tuples
    in the meta come back as lists)."""
    from broker.weights import encode_weights, sha256_hex

    clash = [name for name in checkpoint.weights if name.startswith(OPTIMIZER_PREFIX)]
    if clash:
        raise EncodeError(f"checkpoint weight {clash[0]!r} uses the optimizer's prefix")
    optimizer = {OPTIMIZER_PREFIX + name: t for name, t in checkpoint.optimizer.items()}
    data = encode_weights({**checkpoint.weights, **optimizer})
    try:
        meta: bytes = msgpack.packb(dict(checkpoint.meta), use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as exc:
        raise EncodeError(f"checkpoint meta is not msgpack-serialisable: {exc}") from exc
    return data, sha256_hex(data), meta


def decode_checkpoint(
    what: str, shard: int, applied: int, data: bytes, sha256: str, meta: bytes, saved_at: float
) -> Checkpoint:
    """A stored checkpoint, its weights verified against their sha256."""
    from broker.weights import decode_verified

    stored = decode_verified(data, sha256, len(data), what)
    weights = {n: t for n, t in stored.items() if not n.startswith(OPTIMIZER_PREFIX)}
    optimizer = {n.removeprefix(OPTIMIZER_PREFIX): t for n, t in stored.items() if n not in weights}
    try:
        decoded = msgpack.unpackb(meta, raw=False, strict_map_key=False)
    except (ValueError, TypeError) as exc:  # msgpack's unpack errors are ValueErrors
        raise DecodeError(f"checkpoint meta is not valid msgpack: {exc}") from exc
    if not isinstance(decoded, dict):
        raise DecodeError(f"checkpoint meta must be a map, got {type(decoded).__name__}")
    return Checkpoint(int(shard), applied, weights, decoded, saved_at, optimizer)


def lease_not_held(shard: int, holder: tuple[str, str]) -> LeaseNotHeldError:
    return LeaseNotHeldError(
        f"checkpoint of shard {shard} not saved: {holder[1]!r} does not hold lease {holder[0]!r}"
    )


class PublishingStore(ABC):
    def publish_version(
        self,
        job: str,
        expected_current: int,
        blobs: Mapping[BlobRef, Weights],
        *,
        samples: Mapping[BlobRef, int] | None = None,
        meta: Mapping[str, str] | None = None,
    ) -> int:
        keys.validate_job(job)
        if isinstance(expected_current, bool) or not isinstance(expected_current, int):
            raise TypeError(f"expected_current must be an int, got {expected_current!r}")
        if expected_current < NO_VERSION:
            raise ValueError(f"expected_current must be >= {NO_VERSION}, got {expected_current}")
        checked_meta = str_map("manifest meta", meta)
        version = expected_current + 1
        prepared = prepare_blobs(job, version, blobs, samples)
        # Lets a retried commit whose first reply was lost recognise its own manifest.
        commit_id = uuid.uuid4().hex
        created = self._write_pending(job, prepared)
        try:
            status, detail = self._commit(job, expected_current, prepared, commit_id, checked_meta)
            if status == "conflict":
                raise VersionConflictError(expected_current, int(detail))
            if status == "missing":
                raise StoreError(
                    f"torn write: blob {detail} is missing at commit time; "
                    f"version {expected_current} stays current"
                )
            if status != "ok":
                raise StoreError(f"unexpected commit outcome {status!r} {detail!r}")
        except StoreUnavailableError:
            raise  # outcome unknown; the pending expiry cleans up if it did not commit
        except StoreError:
            # Nobody can commit a version-`version` key any more (the version moved on or our
            # write is torn), and a committed blob is permanent, so deleting those of our blobs
            # that are still pending never hurts a winner that shares identical content. If the
            # cleanup itself fails the blobs still expire, so the original error is what matters.
            with contextlib.suppress(StoreError):
                self._discard_pending(job, created)
            raise
        try:
            self._apply_retention(job)
        except StoreError as exc:
            # The version is committed; failing the call now would make the caller retry a
            # publish that succeeded. The next publish retries retention for every stale version.
            _log.warning(
                "job %s: retention after publishing version %d failed: %s", job, version, exc
            )
        return version

    @abstractmethod
    def _write_pending(self, job: str, blobs: Sequence[PreparedBlob]) -> list[str]:
        """Write each blob unless its key exists; return the keys this call created."""

    @abstractmethod
    def _commit(
        self,
        job: str,
        expected: int,
        blobs: Sequence[PreparedBlob],
        commit_id: str,
        meta: Mapping[str, str],
    ) -> tuple[str, str]:
        """The atomic compare-and-set: ("ok", ""), also for a retry of a commit that went
        through; ("conflict", the current version); ("missing", a blob key): a torn write."""

    @abstractmethod
    def _discard_pending(self, job: str, blob_keys: Sequence[str]) -> None:
        """Delete those of `blob_keys` that are still pending (never a committed blob)."""

    @abstractmethod
    def _apply_retention(self, job: str) -> None:
        """Drop whole versions older than the newest `keep_versions`."""
