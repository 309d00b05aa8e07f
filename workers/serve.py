"""One server step over buffered batches, and the answers it owes their clients.

`serve` runs the strategy's `server_step` on the replica, records every batch it applied and
replies with each gradient, cast back to the dtype the client sent. A step whose loss or
gradients are not finite has poisoned the replica: nothing is recorded or answered, and the
caller rolls back (see `ShardRunner`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from broker.messages import GradientReply, SmashedBatch, new_message_id
from broker.transport import Delivery
from services.algorithms.base import CohortBatch, Strategy
from workers.replica import Replica
from workers.replies import Replier
from workers.stats import WorkerStats


@dataclass(frozen=True)
class Item:
    """A valid batch waiting to be served, with the delivery to ack once it is checkpointed."""

    delivery: Delivery
    batch: SmashedBatch


@dataclass
class Outcome:
    applied: list[Item] = field(default_factory=list)
    # A non-finite step: the batches whose own loss was not finite (all, if none was singled
    # out); the others of the step are retried on a clean replica.
    poisoned: list[Item] = field(default_factory=list)
    failure: Exception | None = None  # server_step raised: a bug, or input the model refuses


def cohort_weight(replica: Replica, batch: SmashedBatch) -> float:
    """MiniBatch-SFL's p_n: the client's samples from RoundStart; its rows otherwise."""
    if batch.round == replica.cohort_round and batch.client in replica.cohort:
        return float(replica.cohort[batch.client])
    return float(batch.labels.shape[0])


def serve(
    items: Sequence[Item],
    replica: Replica,
    strategy: Strategy,
    replier: Replier,
    stats: WorkerStats,
) -> Outcome:
    batches = [
        CohortBatch(
            i.batch.client,
            i.batch.activations,
            i.batch.labels,
            cohort_weight(replica, i.batch),
            cut=i.batch.cut,
        )
        for i in items
    ]
    try:
        results = strategy.server_step(replica.server, replica.optimizer, batches)
    except Exception as exc:  # never let one step take the worker down
        return Outcome(failure=exc)
    if not all(math.isfinite(loss) and bool(torch.isfinite(g).all()) for g, loss, _ in results):
        bad = [
            item
            for item, (_, loss, _) in zip(items, results, strict=True)
            if not math.isfinite(loss)
        ] or list(items)
        return Outcome(poisoned=bad)
    replica.steps += 1
    stats.steps += 1
    for item, (grad, loss, correct) in zip(items, results, strict=True):
        b = item.batch
        rows = int(b.labels.shape[0])
        replica.record(b.client, b.seq, b.step, b.steps, rows, b.cut)
        stats.batches_applied += 1
        reply = GradientReply(
            job=b.job,
            client=b.client,
            message_id=new_message_id(),
            version=replica.version,
            seq=b.seq,
            status="ok",
            loss=loss,
            correct=correct,
            samples=rows,
            # Local-loss algorithms' clients never wait for it: spare the bytes.
            grad=(
                grad.detach().to(device="cpu", dtype=b.activations.dtype).contiguous()
                if strategy.waits_for_gradient
                else None
            ),
        )
        if replier.send(reply):
            stats.replies += 1
        else:
            stats.replies_undeliverable += 1
    return Outcome(applied=list(items))


def answer_duplicate(
    batch: SmashedBatch, version: int, replier: Replier, stats: WorkerStats
) -> None:
    """Answer a copy of a batch applied already (never applying it again).

    A client publishes its batch again when no reply came within its timeout: the reply was
    lost (a broker restart drops transient replies) or is late. Either way it is sent again:
    the reply kept for this seq (`Replier.resend`), same seq and gradient, under a new message
    id; a client that had it already drops the copy. Where no reply is kept (the batch was
    applied by another worker before a failover, or the seq is not the client's last), the
    client is told "gone": it cannot have that gradient, and waiting would not bring it."""
    stats.duplicates_skipped += 1
    resent = replier.resend(batch.job, batch.client, batch.seq)
    if resent is not None:
        if resent:
            stats.replies_resent += 1
        return
    reply = GradientReply(
        job=batch.job,
        client=batch.client,
        message_id=new_message_id(),
        version=version,
        seq=batch.seq,
        status="gone",
        loss=0.0,
        correct=0,
        samples=0,
        grad=None,
        reason=f"duplicate: seq {batch.seq} was already applied; its gradient is no longer kept",
    )
    if replier.send(reply):
        stats.gone_replies += 1
