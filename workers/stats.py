"""What a worker did during one `run`: the counters tests and operators read."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


@dataclass
class WorkerStats:
    """Counters of one `Worker.run`; `dead_lettered` is keyed by reason code."""

    batches_applied: int = 0
    steps: int = 0  # optimizer steps (a folded or barrier step applies several batches)
    duplicates_skipped: int = 0
    dead_lettered: Counter[str] = field(default_factory=Counter)
    checkpoints: int = 0
    replies: int = 0  # status "ok"
    replies_resent: int = 0  # a duplicate answered with the reply kept for its seq
    gone_replies: int = 0  # a duplicate answered "gone": applied, its gradient no longer kept
    replies_undeliverable: int = 0  # the client's reply queue is gone, or the reply too large
    stale_acks: int = 0  # deliveries whose connection was lost; redelivered and deduplicated
    reloads: int = 0  # replica (re)loaded from a published version
    rollbacks: int = 0  # replica reset to its checkpoint after a poisoned step
    shards_acquired: int = 0
    shards_released: int = 0
    shards_lost: int = 0
    too_stale: int = 0  # async mode: smashed data refused as too stale (GradientReply rejected)
    rebases: int = 0  # async mode: replica moved onto a newer version (workers.clock.Continuous)

    @property
    def dead_lettered_total(self) -> int:
        return sum(self.dead_lettered.values())
