"""Collecting the shard replicas of a closed round from the workers' checkpoints.

After RoundEnd reaches a shard queue, the worker holding the shard checkpoints with
`meta["round"] = r` (architecture step 5); its `round_samples` weight the replica in the
server-side average. A shard whose worker does not answer within the timeout is left out (its
samples are lost for this round, the previous server weights stand in for it).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable

from broker.store import Checkpoint, WeightStore
from services.algorithms.base import ShardReplica

_POLL_S = 0.05


def checkpoint_round(checkpoint: Checkpoint) -> int:
    value = checkpoint.meta.get("round", -1)
    return value if isinstance(value, int) else -1


def replica_of(checkpoint: Checkpoint) -> ShardReplica:
    samples = checkpoint.meta.get("round_samples", 0)
    by_cut = checkpoint.meta.get("cut_samples")
    cut_samples = (
        {str(c): n for c, n in by_cut.items() if isinstance(n, int) and n > 0}
        if isinstance(by_cut, dict)
        else {}
    )
    return ShardReplica(
        shard=checkpoint.shard,
        samples=samples if isinstance(samples, int) and samples > 0 else 0,
        weights=dict(checkpoint.weights),
        cut_samples=cut_samples,
    )


def gather_replicas(
    store: WeightStore,
    job: str,
    shards: Iterable[int],
    round_index: int,
    *,
    timeout_s: float,
    clock: Callable[[], float],
    stop: threading.Event,
    logger: logging.Logger,
) -> list[ShardReplica] | None:
    """The replicas of `shards` handed in for round `round_index`, in shard order; None if
    `stop` was set while waiting."""
    pending = sorted(set(shards))
    found: dict[int, ShardReplica] = {}
    deadline = clock() + timeout_s
    while pending:
        for shard in list(pending):
            checkpoint = store.load_checkpoint(job, shard)
            if checkpoint is not None and checkpoint_round(checkpoint) >= round_index:
                found[shard] = replica_of(checkpoint)
                pending.remove(shard)
        if not pending:
            break
        if clock() >= deadline:
            logger.warning(
                "job %s: no replica of shards %s for round %d after %.0f s; going on without",
                job,
                pending,
                round_index,
                timeout_s,
            )
            break
        if stop.wait(_POLL_S):
            return None
    return [found[s] for s in sorted(found)]
