"""Every Redis key name, built in one place (the table and the rules for names:
docs/architecture.md, "Weights and versions")."""

from __future__ import annotations

import re

from broker.store import BlobRef, MemberKind

ROOT = "splitmq"

# Glob-free and without ':', for `job_pattern`'s SCAN MATCH (see the docs above).
_JOB_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]{0,127}")
# Length of the sha256 prefix that makes blob keys content-addressed.
SHA_PREFIX_LEN = 16

# Prefixes of the member ids: a member's kind (`member_kind`), and so the sorted set
# `<job>:members:<kind>` that holds it, follows from its id, so callers name members as they
# always did and a reader of one kind reads no other.
CLIENT_MEMBER_PREFIX = "client:"
WORKER_MEMBER_PREFIX = "worker:"
HEALTH_MEMBER_PREFIX = "health:"
_KIND_PREFIXES = (
    (MemberKind.CLIENT, CLIENT_MEMBER_PREFIX),
    (MemberKind.WORKER, WORKER_MEMBER_PREFIX),
    (MemberKind.HEALTH, HEALTH_MEMBER_PREFIX),
)
# Prefix of a shard's lease name (`<job>:lease:shard:<s>`): the worker consuming that shard.
SHARD_LEASE_PREFIX = "shard:"
# Prefix of the manifest hash fields that name a blob (`blob:<part>:<owner>` -> entry JSON).
BLOB_FIELD_PREFIX = "blob:"


def validate_job(job: str) -> str:
    if not isinstance(job, str) or not _JOB_NAME.fullmatch(job):
        raise ValueError(
            f"invalid job name {job!r}: use 1-128 characters of [A-Za-z0-9_.-], "
            "starting with a letter or digit"
        )
    return job


def validate_ref(ref: BlobRef) -> BlobRef:
    # ':' would make "<part>:<owner>" ambiguous in blob keys and manifest fields.
    for what, value in (("part", ref.part), ("owner", ref.owner)):
        if not isinstance(value, str) or not value or ":" in value:
            raise ValueError(f"invalid blob {what} {value!r}: must be non-empty without ':'")
    return ref


def validate_name(what: str, value: str) -> str:
    """Member ids and lease names: any non-empty string (they are never parsed back)."""
    if not isinstance(value, str) or not value:
        raise ValueError(f"invalid {what} {value!r}: must be a non-empty string")
    return value


def job_prefix(job: str) -> str:
    return f"{ROOT}:{validate_job(job)}:"


def job_pattern(job: str) -> str:
    """SCAN MATCH pattern of every key of `job` (safe: job names hold no glob characters)."""
    return job_prefix(job) + "*"


def version_key(job: str) -> str:
    return job_prefix(job) + "version"


def versions_key(job: str) -> str:  # member and score: the version number
    return job_prefix(job) + "versions"


def manifest_key(job: str, version: int) -> str:
    return job_prefix(job) + f"manifest:{int(version)}"


def blob_key(job: str, ref: BlobRef, version: int, sha256: str) -> str:
    """Content-addressed by its sha suffix (why: docs/architecture.md, store keys)."""
    validate_ref(ref)
    return job_prefix(job) + f"w:{ref.part}:{ref.owner}:{int(version)}:{sha256[:SHA_PREFIX_LEN]}"


def blob_field(ref: BlobRef) -> str:
    return BLOB_FIELD_PREFIX + validate_ref(ref).name


def checkpoint_key(job: str, shard: int) -> str:
    return job_prefix(job) + f"ckpt:{int(shard)}"


def member_kind(member_id: str) -> MemberKind:
    for kind, prefix in _KIND_PREFIXES:
        if member_id.startswith(prefix):
            return kind
    return MemberKind.OTHER


# Before the member kinds, one sorted set `<job>:members` and one hash `<job>:members:info`
# held every member: the keys below never name those two (docs/architecture.md, store keys).
def members_key(job: str, kind: MemberKind) -> str:  # member -> expiry (server time)
    return job_prefix(job) + f"members:{MemberKind(kind)}"


def members_info_key(job: str, kind: MemberKind) -> str:  # member -> info JSON
    return job_prefix(job) + f"members:{MemberKind(kind)}:info"


def status_key(job: str) -> str:
    return job_prefix(job) + "status"


def lease_key(job: str, name: str) -> str:
    return job_prefix(job) + f"lease:{validate_name('lease name', name)}"


# A schedule stream's name (`services.common.schedule`: "aggregator", "shard-3", ...).
_STREAM_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]{0,63}")


def validate_stream(stream: str) -> str:
    if not isinstance(stream, str) or not _STREAM_NAME.fullmatch(stream):
        raise ValueError(
            f"invalid schedule stream {stream!r}: use 1-64 characters of [A-Za-z0-9_.-], "
            "starting with a letter or digit"
        )
    return stream


def schedule_key(job: str, stream: str) -> str:  # list of the stream's encoded entries
    return job_prefix(job) + f"schedule:{validate_stream(stream)}"


def schedule_streams_key(job: str) -> str:  # set of the job's stream names
    return job_prefix(job) + "schedule-streams"


def probe_key(token: str) -> str:
    """Scratch key for `splitmq doctor`; '_' cannot start a job name, so it never collides."""
    return f"{ROOT}:_probe:{token}"
