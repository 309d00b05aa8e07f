"""A shard replica in async mode: it trains continuously and follows the published versions.

Two jobs (docs/async.md, "Server side"):

- **Staleness of smashed data.** A batch computed with client weights more than
  `worker_max_staleness` versions behind the newest version this worker knows of is not
  trained on: it is answered with `GradientReply(status="rejected", reason="too_stale: ...")`
  (its delivery is acked with the next checkpoint, like a duplicate), and the client drops
  its local round and fetches newer weights.
- **Rebasing.** With no RoundEnd there is no moment at which the replica restarts from the
  average: it never reloads. Instead, just before each checkpoint it looks at the newest
  version; if that version folded one of this shard's recent checkpoints (manifest meta
  `server.<s>`, see `services.common.server_fold`), the replica moves onto it, keeping
  the progress it made since that checkpoint: `w <- server(v) + (w - w_folded)`. With one
  shard this changes nothing (the version's server blob *is* the folded checkpoint); with
  several, each replica picks up the others' progress. The optimizer state is kept: the
  replica keeps training, it does not start a new model.

Besides the usual cadence (`checkpoint_every_steps`, `checkpoint_every_s`), a replica
checkpoints as soon as it sees a newer version, so each fold finds recent server progress:
a version's server blob is the replicas as of their last checkpoint.

The weights of recent checkpoints are kept (`_ring`, by applied count, in the replica's
current frame), so a fold of a checkpoint older than the last one still rebases exactly.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import replace

import torch

from broker.errors import VersionNotFoundError
from broker.messages import GradientReply, SmashedBatch, new_message_id
from broker.store import SERVER_PART, BlobRef, Checkpoint, WeightStore
from models.state import load_partial
from services.algorithms.async_fold import rebase_state
from services.algorithms.staleness import TOO_STALE
from services.common.server_fold import NEVER, folded_of
from workers.replica import Replica
from workers.replies import Replier
from workers.stats import WorkerStats

SERVER = BlobRef(SERVER_PART)
# Checkpoints remembered for rebasing; a fold is normally of the last one or the one before.
_RING = 6

State = Mapping[str, torch.Tensor]


class AsyncShard:
    def __init__(
        self,
        replica: Replica,
        store: WeightStore,
        job: str,
        max_staleness: int,
        stats: WorkerStats,
        logger: logging.Logger,
    ) -> None:
        self._replica = replica
        self._store = store
        self._job = job
        self._max_staleness = max_staleness
        self._stats = stats
        self._log = logger
        self.known_version = replica.version
        self._checkpointed_at = replica.version  # known_version at the last checkpoint
        self.anchor_applied = NEVER
        self._ring: dict[int, State] = {}
        self._start()

    def _start(self) -> None:
        """Where the replica's weights are measured from: its checkpoint's anchor, or the
        version it was loaded from."""
        checkpoint = self._store.load_checkpoint(self._job, self._replica.shard)
        if checkpoint is not None and checkpoint.meta.get("version") == self._replica.version:
            anchor_applied = checkpoint.meta.get("anchor_applied", NEVER)
            if isinstance(anchor_applied, int):
                self.anchor_applied = anchor_applied
            self._ring[checkpoint.applied] = dict(checkpoint.weights)
        try:
            self._ring[self.anchor_applied] = self._store.read_blob(
                self._job, self._replica.version, SERVER
            )
        except VersionNotFoundError:
            pass  # anchored at a version no longer kept: rebase from a later checkpoint

    # --- smashed data ------------------------------------------------------------------------
    def unknown_version(self, batch: SmashedBatch) -> str | None:
        """Why `batch` names a version that was never published (dead-lettered), or None.
        The store is asked only when a batch names a version newer than any seen: a forged
        one must not make every honest batch look stale."""
        if batch.version > self.known_version:
            self.known_version = max(self.known_version, self._store.current_version(self._job))
        if batch.version > self.known_version:
            return f"version {batch.version} not found (newest {self.known_version})"
        return None

    def too_stale(self, batch: SmashedBatch) -> str | None:
        """Why `batch` is too stale to train on, or None (after `unknown_version`)."""
        self.known_version = max(self.known_version, batch.version)
        tau = self.known_version - batch.version
        if tau <= self._max_staleness:
            return None
        return (
            f"{TOO_STALE}: smashed data computed with version {batch.version}, "
            f"{tau} versions behind {self.known_version} (max {self._max_staleness})"
        )

    def refuse(self, batch: SmashedBatch, reason: str, replier: Replier) -> None:
        self._stats.too_stale += 1
        reply = GradientReply(
            job=batch.job,
            client=batch.client,
            message_id=new_message_id(),
            version=self.known_version,
            seq=batch.seq,
            status="rejected",
            loss=0.0,
            correct=0,
            samples=0,
            grad=None,
            reason=reason,
        )
        replier.send(reply)

    # --- checkpoints -------------------------------------------------------------------------
    def rebase(self) -> bool:
        """Move the replica onto the newest version if it folded a checkpoint we remember;
        whether it moved."""
        replica = self._replica
        newest = self._store.current_version(self._job)
        self.known_version = max(self.known_version, newest)
        if newest <= replica.version:
            return False
        try:
            meta = self._store.manifest(self._job, newest).meta
            folded = folded_of(meta).get(replica.shard)
            applied = folded.applied if folded is not None else NEVER
            base = self._ring.get(applied)
            if base is None:
                return False  # a fold we cannot place; the next one will be of ours
            target = self._store.read_blob(self._job, newest, SERVER)
        except VersionNotFoundError:
            return False
        own = {n: t.detach().to("cpu") for n, t in replica.server.state_dict().items()}
        moved = rebase_state({n: own[n] for n in target if n in own}, base, target, 1.0)
        load_partial(replica.server, moved)
        self._ring = {
            k: rebase_state(w, base, target, 1.0) for k, w in self._ring.items() if k >= applied
        }
        self._ring[applied] = dict(target)
        replica.version = newest
        self.anchor_applied = applied
        self._stats.rebases += 1
        self._log.info(
            "job %s shard %d: rebased onto version %d (it folded checkpoint %d)",
            self._job,
            replica.shard,
            newest,
            applied,
        )
        return True

    def stamped(self, checkpoint: Checkpoint) -> Checkpoint:
        """The checkpoint with its anchor, for the aggregator's fold."""
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
