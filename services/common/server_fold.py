"""Async mode's server side: folding the continuously training shard replicas into versions.

Each version records, per shard, the checkpoint it folded last (`server.<s>` =
"applied:anchor:samples"); which checkpoint's progress is fresh, and what it is measured from:
docs/async.md, "Server side: replicas that never stop". The worker side is
`workers.clock.Continuous`.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from broker.errors import VersionNotFoundError
from broker.store import SERVER_PART, BlobRef, Checkpoint, WeightStore
from services.algorithms.async_fold import rebased_replica
from services.algorithms.base import ShardReplica

SERVER = BlobRef(SERVER_PART)
META_PREFIX = "server."
NEVER = -1  # anchor_applied of a replica that never rebased onto a fold of its own

State = Mapping[str, torch.Tensor]


@dataclass(frozen=True)
class FoldedCheckpoint:
    applied: int
    anchor: int  # the version the checkpoint's weights are measured from
    samples: int  # the replica's samples trained in all, as of this checkpoint
    cut_samples: Mapping[str, int] = field(default_factory=dict)
    weights: State | None = None  # None when known from a manifest only (after a restart)

    def describe(self) -> str:
        return f"{self.applied}:{self.anchor}:{self.samples}"


# A shard's last fold before it has one: nothing applied, no samples.
_NOTHING_FOLDED = FoldedCheckpoint(NEVER, NEVER, 0)


def meta_int(meta: Mapping[str, Any], key: str, default: int) -> int:
    """A checkpoint's integer `meta[key]` (`default` when absent or of another type)."""
    value = meta.get(key, default)
    return value if isinstance(value, int) and not isinstance(value, bool) else default


def meta_cuts(meta: Mapping[str, Any]) -> dict[str, int]:
    """A checkpoint's samples by cut (FedSplitX levels)."""
    raw = meta.get("cut_samples")
    if not isinstance(raw, Mapping):
        return {}
    return {str(c): n for c, n in raw.items() if isinstance(n, int)}


def folded_of(meta: Mapping[str, str]) -> dict[int, FoldedCheckpoint]:
    """The per-shard `server.<s>` entries of a version's manifest meta."""
    out: dict[int, FoldedCheckpoint] = {}
    for key, value in meta.items():
        shard = key.removeprefix(META_PREFIX)
        if shard == key or not shard.isdigit():
            continue
        try:
            applied, anchor, samples = (int(part) for part in value.split(":"))
        except ValueError:
            continue  # not a fold record of ours
        out[int(shard)] = FoldedCheckpoint(applied, anchor, samples)
    return out


@dataclass
class ServerLedger:
    store: WeightStore
    job: str
    shards: int
    logger: logging.Logger
    folded: dict[int, FoldedCheckpoint] = field(default_factory=dict)
    skipped: int = 0  # checkpoints left for later: their worker had not rebased yet

    def restore(self, meta: Mapping[str, str]) -> None:
        """Resume from the newest version's manifest (a restarted aggregator)."""
        self.folded = folded_of(meta)

    def fresh(self, current: State) -> tuple[list[ShardReplica], dict[int, FoldedCheckpoint]]:
        """The shards' fresh progress replayed on `current` (the current server weights), and
        the checkpoints it came from, to `commit` once the version is published."""
        replicas: list[ShardReplica] = []
        taken: dict[int, FoldedCheckpoint] = {}
        for shard in range(self.shards):
            checkpoint = self.store.load_checkpoint(self.job, shard)
            if checkpoint is None:
                continue
            found = self._fresh_one(checkpoint, current)
            if found is not None:
                replicas.append(found[0])
                taken[shard] = found[1]
        return replicas, taken

    def _fresh_one(
        self, checkpoint: Checkpoint, current: State
    ) -> tuple[ShardReplica, FoldedCheckpoint] | None:
        meta = checkpoint.meta
        now = FoldedCheckpoint(
            applied=checkpoint.applied,
            anchor=meta_int(meta, "version", 0),
            samples=meta_int(meta, "round_samples", 0),
            cut_samples=meta_cuts(meta),
            weights=checkpoint.weights,
        )
        last = self.folded.get(checkpoint.shard, _NOTHING_FOLDED)
        if now.applied == last.applied:
            return None  # nothing new since the last fold
        base = self._base(checkpoint.shard, now, meta_int(meta, "anchor_applied", NEVER), last)
        if base is None:
            self.skipped += 1
            return None
        samples = now.samples - last.samples
        if samples <= 0:
            return None
        old = last.cut_samples
        cuts = {c: n - old.get(c, 0) for c, n in now.cut_samples.items() if n > old.get(c, 0)}
        replica = rebased_replica(
            checkpoint.shard, checkpoint.weights, base, current, samples, cuts
        )
        return replica, now

    def _base(
        self, shard: int, now: FoldedCheckpoint, anchor_applied: int, last: FoldedCheckpoint
    ) -> State | None:
        """What the fresh progress of `now` is measured from, or None if it cannot be told."""
        if last.weights is not None and now.anchor == last.anchor:
            return last.weights
        if anchor_applied == last.applied:
            try:
                return self.store.read_blob(self.job, now.anchor, SERVER)
            except VersionNotFoundError:
                self.logger.info(
                    "job %s: shard %d anchored at version %d, no longer kept; waiting for it to "
                    "rebase",
                    self.job,
                    shard,
                    now.anchor,
                )
        return None

    def commit(self, taken: Mapping[int, FoldedCheckpoint]) -> None:
        self.folded.update(taken)

    def meta(self, taken: Mapping[int, FoldedCheckpoint]) -> dict[str, str]:
        """The `server.<s>` entries of the version about to be published: every shard's last
        folded checkpoint, these ones included."""
        merged = {**self.folded, **taken}
        return {f"{META_PREFIX}{s}": merged[s].describe() for s in sorted(merged)}
