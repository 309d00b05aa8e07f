"""Encoding shared by both weight stores: prepared blobs, manifest fields, checkpoint metadata.

Both stores hold the same bytes (safetensors blobs, msgpack metadata, JSON manifest fields) so
they validate, copy and fail identically; the in-memory store is a faithful stand-in for Redis.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import msgpack

from broker import keys
from broker.errors import DecodeError, EncodeError, StoreError
from broker.store import BlobRef, ManifestEntry, Weights

BLOB_FIELD_PREFIX = "blob:"


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
    # Here, not at the top: the stores import this module, and a store opened only for members
    # (`splitmq check`) must not import torch.
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


def validate_meta(meta: Mapping[str, str] | None) -> dict[str, str]:
    result = dict(meta or {})
    for k, v in result.items():
        if not isinstance(k, str) or not isinstance(v, str):
            raise ValueError(f"manifest meta must map str to str, got {k!r}: {v!r}")
    return result


def blob_field(ref: BlobRef) -> str:
    return BLOB_FIELD_PREFIX + ref.name


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


def encode_meta(meta: Mapping[str, Any]) -> bytes:
    """msgpack bytes of checkpoint metadata (tuples come back as lists)."""
    try:
        packed: bytes = msgpack.packb(dict(meta), use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as exc:
        raise EncodeError(f"checkpoint meta is not msgpack-serialisable: {exc}") from exc
    return packed


def decode_meta(data: bytes) -> dict[str, Any]:
    try:
        meta = msgpack.unpackb(data, raw=False, strict_map_key=False)
    except (ValueError, TypeError) as exc:  # msgpack's unpack errors are ValueErrors
        raise DecodeError(f"checkpoint meta is not valid msgpack: {exc}") from exc
    if not isinstance(meta, dict):
        raise DecodeError(f"checkpoint meta must be a map, got {type(meta).__name__}")
    return meta


def encode_info(info: Mapping[str, str]) -> str:
    for k, v in info.items():
        if not isinstance(k, str) or not isinstance(v, str):
            raise ValueError(f"member info must map str to str, got {k!r}: {v!r}")
    return json.dumps(dict(info), sort_keys=True)


def decode_info(raw: bytes | str) -> dict[str, str]:
    try:
        obj = json.loads(raw)
    except ValueError as exc:
        raise StoreError(f"malformed member info {raw!r}: {exc}") from exc
    if not isinstance(obj, dict):
        raise StoreError(f"malformed member info {raw!r}")
    return {str(k): str(v) for k, v in obj.items()}
