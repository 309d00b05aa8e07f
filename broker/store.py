"""The store protocols: versions, shard checkpoints, and members/leases/job status. How a
version is published so that a crash or a race never leaves a torn one: docs/architecture.md,
"Weights and versions".
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING, Any, Protocol, TypeAlias, runtime_checkable

if TYPE_CHECKING:
    # Only named in annotations: opening a store to read members or leases (`splitmq check`,
    # a healthcheck every few seconds) must not pay for importing torch.
    import torch

Weights: TypeAlias = "Mapping[str, torch.Tensor]"

# Part names of design §6.
CLIENT_PART = "client"
AUX_PART = "aux"
SERVER_PART = "server"
GLOBAL_OWNER = "global"

# Version number when nothing has been published yet; the first publication creates version 1.
NO_VERSION = 0


@dataclass(frozen=True, order=True)
class BlobRef:
    """Which weights a blob holds: `part` (client/aux/server) owned by `owner` (global, a client
    id or a shard id)."""

    part: str
    owner: str = GLOBAL_OWNER

    @property
    def name(self) -> str:
        return f"{self.part}:{self.owner}"


@dataclass(frozen=True)
class ManifestEntry:
    ref: BlobRef
    sha256: str
    nbytes: int
    samples: int = 0


@dataclass(frozen=True)
class Manifest:
    version: int
    entries: Mapping[BlobRef, ManifestEntry]
    created_at: float = 0.0
    meta: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Checkpoint:
    """A shard replica and how many server updates it has applied; its msgpack-able `meta`
    (docs/architecture.md, "Weights and versions") lets a resuming worker apply each
    redelivered batch exactly once."""

    shard: int
    applied: int
    weights: Weights
    meta: Mapping[str, Any] = field(default_factory=dict)
    saved_at: float = 0.0
    # The replica's optimizer state as flat tensors (`<param>.<key>`), stored in the same
    # safetensors blob under OPTIMIZER_PREFIX; empty in a checkpoint from before it was kept.
    optimizer: Weights = field(default_factory=dict)


# Job states of a `JobStatus`: the job is over, either way.
JOB_FINISHED = "finished"
JOB_FAILED = "failed"
JOB_STATES = (JOB_FINISHED, JOB_FAILED)


@dataclass(frozen=True)
class JobStatus:
    """How a job ended, recorded by its aggregator before it dismisses the members; a job
    without one is running (or not started). When a name's record is forgotten:
    docs/reliability.md, **An ended job stays ended**."""

    state: str  # JOB_FINISHED or JOB_FAILED
    detail: str = ""  # why it failed ("" when finished)

    def __post_init__(self) -> None:
        if self.state not in JOB_STATES:
            raise ValueError(f"job state must be one of {JOB_STATES}, got {self.state!r}")

    @property
    def text(self) -> str:
        """The status as a run reports it: "finished" or "failed: <detail>"."""
        if self.state == JOB_FAILED:
            return f"{JOB_FAILED}: {self.detail or 'no reason given'}"
        return self.state


@dataclass(frozen=True)
class Member:
    member_id: str
    expires_at: float
    info: Mapping[str, str] = field(default_factory=dict)


class MemberKind(StrEnum):
    """What a member is, told by its id's prefix (`broker.keys.member_kind`). The store keeps
    each kind apart, so that a read of one kind (the workers counting workers, the coordinator
    and the aggregator reading clients) costs nothing for the members of the others."""

    CLIENT = "client"
    WORKER = "worker"
    HEALTH = "health"
    OTHER = "other"  # an id with none of the prefixes


class _Closable(Protocol):
    def close(self) -> None: ...


class VersionStore(_Closable, Protocol):
    """Published versions of a job: manifests and their content-addressed blobs."""

    def current_version(self, job: str) -> int:
        """The newest committed version, or `NO_VERSION`."""
        ...

    def publish_version(
        self,
        job: str,
        expected_current: int,
        blobs: Mapping[BlobRef, Weights],
        *,
        samples: Mapping[BlobRef, int] | None = None,
        meta: Mapping[str, str] | None = None,
    ) -> int:
        """Write the blobs, then atomically commit version `expected_current + 1`.

        Raises `VersionConflictError` if the current version is no longer `expected_current`
        (another aggregator won). Applies retention after a successful commit.
        """
        ...

    def manifest(self, job: str, version: int) -> Manifest:
        """The manifest of `version`; `VersionNotFoundError` if absent or expired by retention."""
        ...

    def read_blob(self, job: str, version: int, ref: BlobRef) -> dict[str, torch.Tensor]:
        """One blob of a version, verified against its manifest sha256."""
        ...

    def versions(self, job: str) -> list[int]:
        """Versions still retained, oldest first."""
        ...


class CheckpointStore(_Closable, Protocol):
    """Shard checkpoints, one per shard, each written whole."""

    def save_checkpoint(
        self, job: str, checkpoint: Checkpoint, *, holder: tuple[str, str] | None = None
    ) -> None:
        """Atomically replace the shard's checkpoint; with `holder` = (lease name, owner), only
        while `owner` holds that lease, checked in the same atomic step, else `LeaseNotHeldError`
        and nothing is written (why: docs/reliability.md, "Redis restart")."""
        ...

    def load_checkpoint(self, job: str, shard: int) -> Checkpoint | None: ...


class MemberStore(_Closable, Protocol):
    """The small, fast-changing records of a job: members (liveness by expiry), leases (e.g. a
    worker's claim on a shard) and how the job ended."""

    def heartbeat(
        self, job: str, member_id: str, ttl_s: float, info: Mapping[str, str] | None = None
    ) -> None: ...

    def renew_members(self, job: str, member_ids: Sequence[str], ttl_s: float) -> list[bool]:
        """Extend each live member's expiry to `ttl_s` from now, its info kept, in one atomic
        step (one round trip); per id, whether it was live. A member that was not stays
        absent: only `heartbeat` (a Join) brings one back, with its info."""
        ...

    def member(self, job: str, member_id: str) -> Member | None:
        """One member if it is live (no scan of the others)."""
        ...

    def remove_member(self, job: str, member_id: str) -> None: ...

    def live_members(self, job: str, kind: MemberKind | None = None) -> dict[str, Member]:
        """Members of `kind` (of every kind when None) whose last heartbeat has not yet expired
        (the expired ones of that kind are pruned); no member of another kind is read."""
        ...

    def member_ttls(self, job: str, member_ids: Sequence[str]) -> list[float | None]:
        """Per id, the seconds before that member expires if it is live, else None; the
        expired ones among them are pruned, in the same atomic step (one round trip, no read of
        the other members: the coordinator's sweep asks for the members it expects expired)."""
        ...

    def acquire_lease(self, job: str, name: str, owner: str, ttl_s: float) -> bool:
        """Take or renew lease `name` for `owner`; False if someone else holds it."""
        ...

    def release_lease(self, job: str, name: str, owner: str) -> None:
        """Release the lease if `owner` still holds it."""
        ...

    def set_job_status(self, job: str, status: JobStatus) -> None:
        """Record that the job ended (replaces an earlier record whole)."""
        ...

    def job_status(self, job: str) -> JobStatus | None:
        """How the job ended; None while it runs (or never ran)."""
        ...

    def clear_job_status(self, job: str) -> None:
        """Forget how the job ended: a new run of the same job name starts (version 1)."""
        ...


@runtime_checkable
class ScheduleStore(Protocol):
    """A run's schedule record (`services.common.schedule`): per stream (one per deciding role:
    "aggregator", "coordinator", "shard-<s>"), the encoded entries in the order appended. The
    store keeps the lines as given and never parses them; they go with the job's other keys
    (`WeightStore.delete_job`). Runtime-checkable: the run directory's writer takes any
    `VersionStore` and keeps the record when the store has one."""

    def append_schedule(self, job: str, stream: str, lines: Sequence[str]) -> None:
        """Append `lines` to `stream`, in order, in one step (one round trip for Redis)."""
        ...

    def read_schedule(self, job: str) -> dict[str, list[str]]:
        """Every stream of the job with its lines in append order; {} for an unknown job."""
        ...


class WeightStore(VersionStore, CheckpointStore, MemberStore, ScheduleStore, Protocol):
    """All of a job's store: what the wiring opens (the Redis store, or the in-memory one of an
    embedded run). Code that needs one concern takes the protocol of that concern."""

    def delete_job(self, job: str) -> None:
        """Remove every key of a job (tests and operators)."""
        ...
