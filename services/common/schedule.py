"""A run's schedule: what the roles decided, in the order they decided it (issue 36).

The record `splitmq replay` re-executes: per shard the batches its replica applied (and the
checkpoints and restores between them), per published version the fold that made it, and the
membership events that chose who trained. Each deciding role writes its own stream through the
store (`ScheduleStore`), so the record survives the role and is complete for a distributed
run; the run directory gets all streams in one file at the end (`services.common.schedule_file`).

Entries are small frozen dataclasses, one JSON object per line on the wire and in the file
(`encode` / `decode`); no pickle, nothing executable. A batch is named by its client, round and
step (its index in the client's round), never by its seq: seqs are clocks of a Welcome, and a
replay's are others.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any, TypeAlias

# Where the roles append their streams: the store's protocol, one definition.
from broker.store import BlobRef, ScheduleStore

FORMAT = 1

# Stream names: one per writer, so two writers never interleave their lines.
AGGREGATOR_STREAM = "aggregator"
COORDINATOR_STREAM = "coordinator"


def shard_stream(shard: int) -> str:
    return f"shard-{shard}"


@dataclass(frozen=True)
class Applied:
    """A batch the shard's replica applied, `position` the replica's applied count after it
    (several batches of one server step share `step_no`)."""

    shard: int
    client: str
    round: int
    step: int
    version: int  # the replica's version when it applied the batch
    position: int
    step_no: int
    worker: str = ""


@dataclass(frozen=True)
class Checkpointed:
    """A checkpoint of the shard covering its first `position` applied batches; `digest` of
    the replica's server-side weights (`state_digest`): a replay that reaches another state
    here has diverged from the record."""

    shard: int
    position: int
    version: int
    digest: str
    worker: str = ""


@dataclass(frozen=True)
class Restored:
    """A worker took the shard over from its checkpoint at `position` (a lease hand-over or a
    restart): the batches recorded after `position` by the previous holder were lost with it."""

    shard: int
    position: int
    version: int
    worker: str


@dataclass(frozen=True)
class FoldedUpdate:
    """One update of a fold: `weight` the staleness rule's weight of its change (async; 1.0 in
    a sync round), `samples` the rows it trained (the fold's sample weight)."""

    client: str
    base_version: int  # the version the client trained from
    staleness: int
    weight: float
    samples: float = 0.0


@dataclass(frozen=True)
class Folded:
    """Version `version` published from these updates (in fold order) and shard replicas
    (shard, applied count); `digest` of its weights (`state_digest`)."""

    version: int
    round: int
    updates: tuple[FoldedUpdate, ...]
    replicas: tuple[tuple[int, int], ...]
    digest: str
    # Sync rounds: the round's cohort (who was asked to train, sorted); () in async folds.
    cohort: tuple[str, ...] = ()


@dataclass(frozen=True)
class MemberEvent:
    """A membership event: `kind` join / leave / drop (a member gone silent) / dropped_round
    (a client that gave up its round); `round` the round open at the time (-1: none)."""

    kind: str
    client: str
    round: int
    partition: int = -1
    shard: int = -1


@dataclass(frozen=True)
class Header:
    """The file's first line: what ran, and how."""

    job: str
    seed: int
    deterministic: bool
    mode: str  # "sync" | "async"
    torch_threads: int
    format: int = FORMAT
    streams: tuple[str, ...] = field(default_factory=tuple)


Entry: TypeAlias = Applied | Checkpointed | Restored | Folded | MemberEvent | Header
_KINDS: dict[str, type[Entry]] = {
    "applied": Applied,
    "checkpointed": Checkpointed,
    "restored": Restored,
    "folded": Folded,
    "member": MemberEvent,
    "header": Header,
}
_NAMES = {cls: name for name, cls in _KINDS.items()}
# The key of an encoded entry's type ("applied", "folded", ...).
ENTRY_KEY = "entry"


BatchKey: TypeAlias = tuple[str, int, int]  # client, round, step


@dataclass(frozen=True)
class ShardHistory:
    """What a shard's replica state is made of: its Applied entries with the ones a take-over
    lost cut away (`Restored` at position n keeps the first n)."""

    batches: tuple[BatchKey, ...]  # in order
    digests: Mapping[int, str]  # position -> digest of the last checkpoint written there
    restores: int


def shard_history(entries: Iterable[Entry]) -> ShardHistory:
    """A shard stream's effective history: what `splitmq replay` compares and what a replay's
    worker serves in order (`workers.sequencer.RecordedOrder`)."""
    batches: list[BatchKey] = []
    digests: dict[int, str] = {}
    restores = 0
    for e in entries:
        if isinstance(e, Applied):
            batches.append((e.client, e.round, e.step))
        elif isinstance(e, Restored):
            del batches[e.position :]
            restores += 1
        elif isinstance(e, Checkpointed) and e.position <= len(batches):
            digests[e.position] = e.digest
    return ShardHistory(tuple(batches), digests, restores)


class ScheduleError(ValueError):
    """A line that is not a schedule entry; the message says which and why."""


def encode(entry: Entry) -> str:
    # The type goes under ENTRY_KEY, not "kind": `MemberEvent` has a field of that name.
    # `vars`, with nested entries (a fold's updates) by the hook: `asdict`'s deep copy costs
    # more than the rest of a shard's record together.
    body = {ENTRY_KEY: _NAMES[type(entry)], **vars(entry)}
    return json.dumps(body, separators=(",", ":"), default=vars)


def decode(line: str) -> Entry:
    try:
        raw = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ScheduleError(f"not JSON: {exc}") from None
    if not isinstance(raw, dict) or not isinstance(raw.get(ENTRY_KEY), str):
        raise ScheduleError(f"not an object with an {ENTRY_KEY!r}")
    cls = _KINDS.get(raw.pop(ENTRY_KEY))
    if cls is None:
        raise ScheduleError(f"unknown entry type in {line[:80]!r}")
    names = {f.name for f in fields(cls)}
    if not set(raw) <= names:
        raise ScheduleError(f"{cls.__name__}: unknown fields {sorted(set(raw) - names)}")
    try:
        if cls is Folded:
            raw["updates"] = tuple(FoldedUpdate(**u) for u in raw["updates"])
            raw["replicas"] = tuple((int(s), int(n)) for s, n in raw["replicas"])
            raw["cohort"] = tuple(str(c) for c in raw.get("cohort", ()))
        if cls is Header:
            raw["streams"] = tuple(raw.get("streams", ()))
        return cls(**raw)
    except (TypeError, KeyError, ValueError) as exc:
        raise ScheduleError(f"{cls.__name__}: {exc}") from None


class ScheduleLog:
    """One role's stream: entries buffered by `add` (encoded when written: a shard adds one
    per batch and writes them every step or every checkpoint), written by `flush` (one store
    call)."""

    def __init__(self, store: ScheduleStore, job: str, stream: str) -> None:
        self._store, self._job, self.stream = store, job, stream
        self.pending: list[Entry] = []

    def add(self, entry: Entry) -> None:
        self.pending.append(entry)

    def flush(self) -> None:
        if self.pending:
            entries, self.pending = self.pending, []
            self._store.append_schedule(self._job, self.stream, [encode(e) for e in entries])


def state_digest(tensors: Mapping[str, Any]) -> str:
    """A short digest of named tensors' exact bytes (names sorted): equal states, equal
    digests, on any machine; a bit of difference, another digest."""
    import hashlib

    import torch

    h = hashlib.blake2b(digest_size=16)
    for name in sorted(tensors):
        t: torch.Tensor = tensors[name].detach().cpu().contiguous()
        h.update(name.encode())
        h.update(str(t.dtype).encode())
        h.update(str(tuple(t.shape)).encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def weights_digest(blobs: Mapping[BlobRef, Mapping[str, Any]]) -> str:
    """`state_digest` of a version's blobs, each tensor named `<part>:<owner>/<name>`: what a
    `Folded` entry records of the weights it published."""
    return state_digest(
        {f"{ref.name}/{name}": t for ref, state in blobs.items() for name, t in state.items()}
    )
