"""The clock an async shard's replica follows (`Continuous`); sync rounds need none: their
markers drive the replica. The rules (staleness refusal, checkpoint cadence, rebasing
`w <- server(v) + (w - w_folded)`) are docs/async.md's, "Server side". What the code adds:
recent checkpoints' weights are kept (`_ring`, by applied count, in the replica's current
frame), so a fold of a checkpoint older than the last one still rebases exactly.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Mapping
from dataclasses import dataclass, replace

import torch

from broker.errors import VersionNotFoundError
from broker.messages import SmashedBatch
from broker.rejection import Rejection
from broker.store import Checkpoint, WeightStore
from models.state import load_partial
from services.algorithms.async_fold import rebase_state
from services.algorithms.staleness import TOO_STALE
from services.common.server_fold import NEVER, folded_of
from workers.replica import SERVER, Replica
from workers.stats import WorkerStats

# Checkpoints remembered for rebasing; a fold is normally of the last one or the one before.
_RING = 6

State = Mapping[str, torch.Tensor]


@dataclass(eq=False)
class Continuous:
    """Async buffering: staleness refusals and rebasing at checkpoints (see the module doc)."""

    replica: Replica
    store: WeightStore
    job: str
    max_staleness: int
    stats: WorkerStats
    log: logging.Logger

    def __post_init__(self) -> None:
        self.restart()

    def restart(self) -> None:
        """Measure the replica's weights from its checkpoint's anchor, or from the version it
        was loaded from (at the start, and after a rollback to the last checkpoint)."""
        replica = self.replica
        self.known_version = replica.version  # the newest version this worker knows of
        self._checkpointed_at = replica.version  # known_version at the last checkpoint
        self.anchor_applied = NEVER
        self._ring: dict[int, State] = {}
        checkpoint = self.store.load_checkpoint(self.job, replica.shard)
        if checkpoint is not None and checkpoint.meta.get("version") == replica.version:
            anchor_applied = checkpoint.meta.get("anchor_applied", NEVER)
            if isinstance(anchor_applied, int):
                self.anchor_applied = anchor_applied
            self._ring[checkpoint.applied] = dict(checkpoint.weights)
        # Anchored at a version no longer kept: rebase from a later checkpoint.
        with contextlib.suppress(VersionNotFoundError):
            self._ring[self.anchor_applied] = self.store.read_blob(
                self.job, replica.version, SERVER
            )

    # --- smashed data ------------------------------------------------------------------------
    def refusal(self, batch: SmashedBatch) -> Rejection | None:
        """`unknown_version`, to dead-letter; TOO_STALE, to answer and not train
        on; None to train on it (docs/async.md, "Stale smashed data")."""
        if batch.version > self.known_version:
            self.known_version = max(self.known_version, self.store.current_version(self.job))
            if batch.version > self.known_version:
                detail = f"version {batch.version} not found (newest {self.known_version})"
                return Rejection("unknown_version", detail)
        tau = self.known_version - batch.version
        if tau <= self.max_staleness:
            return None
        return Rejection(
            TOO_STALE,
            f"{TOO_STALE}: smashed data computed with version {batch.version}, "
            f"{tau} versions behind {self.known_version} (max {self.max_staleness})",
        )

    # --- checkpoints -------------------------------------------------------------------------
    def rebase(self) -> bool:
        """Move the replica onto the newest version if it folded a checkpoint we remember;
        whether it moved."""
        replica = self.replica
        newest = self.store.current_version(self.job)
        self.known_version = max(self.known_version, newest)
        if newest <= replica.version:
            return False
        try:
            meta = self.store.manifest(self.job, newest).meta
            folded = folded_of(meta).get(replica.shard)
            applied = folded.applied if folded is not None else NEVER
            base = self._ring.get(applied)
            if base is None:
                return False  # a fold we cannot place; the next one will be of ours
            target = self.store.read_blob(self.job, newest, SERVER)
        except VersionNotFoundError:
            return False
        own = {n: t.detach().to("cpu") for n, t in replica.server.state_dict().items()}
        load_partial(
            replica.server, rebase_state({n: own[n] for n in target if n in own}, base, target, 1.0)
        )
        self._ring = {
            k: rebase_state(w, base, target, 1.0) for k, w in self._ring.items() if k >= applied
        }
        self._ring[applied] = dict(target)
        replica.version = newest
        self.anchor_applied = applied
        self.stats.rebases += 1
        self.log.info(
            "job %s shard %d: rebased onto version %d (it folded checkpoint %d)",
            *(self.job, replica.shard, newest, applied),
        )
        return True

    def save(self) -> Checkpoint:
        """The checkpoint to save, rebased first and stamped with its anchor for the fold."""
        self.rebase()
        checkpoint = self.replica.checkpoint()
        return replace(checkpoint, meta={**checkpoint.meta, "anchor_applied": self.anchor_applied})

    def due(self) -> bool:
        """A newer version appeared since the last checkpoint: the aggregator folded, and the
        next fold should find this replica's newest progress (and it may rebase now)."""
        return self.known_version > self._checkpointed_at

    def saved(self, checkpoint: Checkpoint) -> None:
        self._checkpointed_at = self.known_version
        self._ring[checkpoint.applied] = checkpoint.weights
        # The anchor's own entry stays: a version may fold no newer checkpoint of this shard.
        others = [k for k in sorted(self._ring) if k != self.anchor_applied]
        for old in others[:-_RING]:
            del self._ring[old]
