"""Everything one held shard does with its deliveries (architecture doc, sync round step 5).

RoundStart → remember the cohort. SmashedBatch → validate, skip duplicates (seq at or below
the client's last applied one), reload on a newer version, then the strategy's server step:
one message at a time, up to `batch_messages` folded, or MiniBatch-SFL's step barrier; reply.
RoundEnd → hand the replica in with a checkpoint. Deliveries stay unacked until a checkpoint
covers them (design §7): a crash at any instant loses nothing, and the seqs in the checkpoint
make every redelivered batch apply exactly once.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from broker.errors import StaleDeliveryError, VersionNotFoundError
from broker.messages import GradientReply, RoundEnd, RoundStart, SmashedBatch, new_message_id
from broker.store import WeightStore
from broker.transport import Broker, Delivery
from services.algorithms.base import CohortBatch, Strategy
from workers.barrier import StepBarrier
from workers.checks import (
    ShardExpectations,
    check_addressing,
    check_batch,
    check_membership,
    parse_cohort,
)
from workers.deadletter import reject
from workers.replica import Replica
from workers.replies import Replier
from workers.stats import WorkerStats

ShardMessage = RoundStart | SmashedBatch | RoundEnd


class LeaseLostError(Exception):
    """Another worker holds this shard's lease now: drop the shard without checkpointing."""


@dataclass(frozen=True)
class ShardPolicy:
    batch_messages: int
    checkpoint_every_steps: int
    checkpoint_every_s: float
    pending_limit: int  # checkpoint before this many unacked deliveries: prefetch is finite
    barrier_timeout_s: float


@dataclass(frozen=True)
class _Item:
    delivery: Delivery
    batch: SmashedBatch


@dataclass
class ShardServices:
    """What a shard needs from its worker: one broker handle, the store, counters."""

    broker: Broker
    store: WeightStore
    strategy: Strategy
    replier: Replier
    stats: WorkerStats
    renew_lease: Callable[[int], bool]
    clock: Callable[[], float]
    logger: logging.Logger


class ShardRunner:
    def __init__(
        self, replica: Replica, want: ShardExpectations, policy: ShardPolicy, io: ShardServices
    ) -> None:
        self.replica = replica
        self._want = want
        self._policy = policy
        self._io = io
        self._pending: list[Delivery] = []  # handled, waiting for a checkpoint to ack them
        self._pending_since = 0.0
        self._steps_since = 0
        self._dirty = False
        self._fold: list[_Item] = []
        self._barrier: StepBarrier[_Item] = StepBarrier(policy.barrier_timeout_s)

    @property
    def shard(self) -> int:
        return self.replica.shard

    def buffered(self) -> int:
        """Valid batches received but not applied yet (they go back to the queue on stop)."""
        return len(self._fold) + len(self._barrier)

    def deadline(self) -> float | None:
        return self._barrier.deadline()

    # --- deliveries ---------------------------------------------------------------------------
    def handle(self, delivery: Delivery, message: ShardMessage) -> None:
        if isinstance(message, SmashedBatch):
            self._on_batch(delivery, message)
        elif isinstance(message, RoundStart):
            self._on_round_start(delivery, message)
        else:
            self._on_round_end(delivery, message)

    def _on_batch(self, delivery: Delivery, batch: SmashedBatch) -> None:
        replica = self.replica
        problem = check_batch(batch, self._want) or check_membership(
            batch, replica.cohort_round, replica.cohort
        )
        if problem is None and not self._io.strategy.splits:
            problem = ("no_server_side", f"algorithm {self._io.strategy.name} does not split")
        if problem is not None:
            self._reject(delivery, *problem)
            return
        if self._is_duplicate(batch):
            self._skip_duplicate(delivery, batch)
            return
        if batch.version > replica.version:
            self.settle()
            if not self._reload(batch.version):
                self._reject(delivery, "unknown_version", f"version {batch.version} not found")
                return
        item = _Item(delivery, batch)
        if self._io.strategy.server_barrier:
            self._barrier.add(batch.client, item, self._io.clock())
            self._step_barrier(force=False)
        else:
            self._fold.append(item)
            if len(self._fold) >= self._policy.batch_messages:
                self.flush()

    def _on_round_start(self, delivery: Delivery, message: RoundStart) -> None:
        cohort, problem = parse_cohort(message, self._want)
        if problem is not None or cohort is None:
            self._reject(delivery, *(problem or ("bad_cohort", "unusable participants")))
            return
        self.settle()
        if message.version > self.replica.version and not self._reload(message.version):
            self._io.logger.warning(
                "job %s shard %d: RoundStart %d names version %d, which is not in the store",
                self._want.job,
                self.shard,
                message.round,
                message.version,
            )
        if message.round >= self.replica.cohort_round:
            if message.round > self.replica.cohort_round:
                self._barrier.new_round()
            self.replica.begin_round(message.round, cohort)
        self._hold(delivery)

    def _on_round_end(self, delivery: Delivery, message: RoundEnd) -> None:
        problem = check_addressing(message, self._want)
        if problem is not None:
            self._reject(delivery, *problem)
            return
        # Every batch of the round is ahead of this marker: serve what is still buffered.
        self.settle()
        handed_in = self.replica.end_round(message.round)
        self._hold(delivery)
        self.checkpoint(force=True)
        if handed_in:
            self._io.logger.info(
                "job %s shard %d: round %d handed in (%d samples, %d applied in total)",
                self._want.job,
                self.shard,
                message.round,
                self.replica.round_samples,
                self.replica.applied,
            )
            self.replica.start_counting()

    # --- stepping -----------------------------------------------------------------------------
    def flush(self) -> None:
        """Apply folded batches now (the queue had nothing more to fold with them)."""
        if self._fold:
            items, self._fold = self._fold, []
            self._apply(items)

    def settle(self) -> None:
        """Serve every buffered batch: before a round marker or a version change."""
        self.flush()
        self._step_barrier(force=True)

    def poll(self) -> None:
        """Time-driven work: a barrier past its timeout, a checkpoint that is due."""
        self._step_barrier(force=False)
        now = self._io.clock()
        if self._pending and (
            self._steps_since >= self._policy.checkpoint_every_steps
            or len(self._pending) >= self._policy.pending_limit
            or now - self._pending_since >= self._policy.checkpoint_every_s
        ):
            self.checkpoint()

    def _step_barrier(self, *, force: bool) -> None:
        replica = self.replica
        while len(self._barrier) and (
            force
            or self._barrier.ready(replica.cohort, replica.progress)
            or self._barrier.expired(self._io.clock())
        ):
            items = self._barrier.take(replica.cohort, replica.progress)
            if self._barrier.dropped:
                self._io.logger.info(
                    "job %s shard %d round %d: barrier stopped waiting for %s",
                    self._want.job,
                    self.shard,
                    replica.cohort_round,
                    sorted(self._barrier.dropped),
                )
            self._apply(items)

    def _weight(self, batch: SmashedBatch) -> float:
        replica = self.replica
        if batch.round == replica.cohort_round and batch.client in replica.cohort:
            return float(replica.cohort[batch.client])
        return float(batch.labels.shape[0])

    def _apply(self, items: list[_Item]) -> None:
        io, replica = self._io, self.replica
        batches = [
            CohortBatch(i.batch.client, i.batch.activations, i.batch.labels, self._weight(i.batch))
            for i in items
        ]
        try:
            results = io.strategy.server_step(replica.server, replica.optimizer, batches)
        except Exception as exc:  # a bug or a shape the model rejects: never crash the worker
            io.logger.exception("job %s shard %d: server step failed", self._want.job, self.shard)
            for item in items:
                self._reject(item.delivery, "server_step", repr(exc))
            return
        if not all(math.isfinite(loss) and bool(torch.isfinite(g).all()) for g, loss, _ in results):
            self._rollback(items, [loss for _, loss, _ in results])
            return
        replica.steps += 1
        self._steps_since += 1
        for item, (grad, loss, correct) in zip(items, results, strict=True):
            b = item.batch
            rows = int(b.labels.shape[0])
            replica.record(b.client, b.seq, b.step, b.steps, rows)
            io.stats.batches_applied += 1
            self._hold(item.delivery)
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
                grad=grad.detach().to(device="cpu", dtype=b.activations.dtype).contiguous(),
            )
            if io.replier.send(reply):
                io.stats.replies += 1
            else:
                io.stats.replies_undeliverable += 1
        io.stats.steps += 1

    def _rollback(self, items: list[_Item], losses: list[float]) -> None:
        """A step went non-finite: the replica is poisoned. Reject the batches whose own loss
        is non-finite (all of them if none is singled out), go back to the last checkpoint and
        requeue everything applied since, which will be applied again on the clean state."""
        io = self._io
        culprits = [i for i, loss in zip(items, losses, strict=True) if not math.isfinite(loss)]
        culprits = culprits or items
        for item in culprits:
            self._reject(item.delivery, "non_finite", f"server step on seq {item.batch.seq}")
        innocent = [i.delivery for i in items if i not in culprits]
        returned = self._pending + innocent + [i.delivery for i in self._barrier.clear()]
        returned += [i.delivery for i in self._fold]
        self._pending, self._fold = [], []
        for delivery in returned:
            try:
                io.broker.nack(delivery, requeue=True)
            except StaleDeliveryError:
                io.stats.stale_acks += 1
        fresh = self.replica.reset(io.store, self._want.job)
        io.stats.rollbacks += 1
        self._steps_since, self._dirty = 0, False
        io.logger.error(
            "job %s shard %d: non-finite server step; replica reset to %s, %d requeued",
            self._want.job,
            self.shard,
            fresh,
            len(returned),
        )

    # --- bookkeeping --------------------------------------------------------------------------
    def _is_duplicate(self, batch: SmashedBatch) -> bool:
        last = self.replica.last_seq(batch.client)
        waiting = [
            i.batch.seq
            for i in self._fold + self._barrier.items()
            if i.batch.client == batch.client
        ]
        highest = max([s for s in [last, *waiting] if s is not None], default=None)
        return highest is not None and batch.seq <= highest

    def _skip_duplicate(self, delivery: Delivery, batch: SmashedBatch) -> None:
        io = self._io
        io.stats.duplicates_skipped += 1
        self._hold(delivery)
        # The client may have republished because its reply was lost: tell it, so it moves on.
        reply = GradientReply(
            job=batch.job,
            client=batch.client,
            message_id=new_message_id(),
            version=self.replica.version,
            seq=batch.seq,
            status="stale",
            loss=0.0,
            correct=0,
            samples=0,
            grad=None,
            reason=f"duplicate: seq {batch.seq} was already applied",
        )
        if io.replier.send(reply):
            io.stats.stale_replies += 1

    def _reload(self, version: int) -> bool:
        try:
            self.replica.load_version(self._io.store, self._want.job, version)
        except VersionNotFoundError:
            return False
        self._dirty = True
        self._io.stats.reloads += 1
        self._io.logger.info(
            "job %s shard %d: replica reloaded from version %d", self._want.job, self.shard, version
        )
        return True

    def _hold(self, delivery: Delivery) -> None:
        if not self._pending:
            self._pending_since = self._io.clock()
        self._pending.append(delivery)
        self._dirty = True

    def _reject(self, delivery: Delivery, code: str, detail: str) -> None:
        reject(self._io.broker, delivery, code, detail, self._io.stats, self._io.logger)

    def checkpoint(self, *, force: bool = False) -> None:
        """Save the replica, then ack what it covers (raises `LeaseLostError`)."""
        if not (force or self._dirty or self._pending):
            return
        io = self._io
        if not io.renew_lease(self.shard):
            raise LeaseLostError(f"shard {self.shard}: lease taken over")
        io.store.save_checkpoint(self._want.job, self.replica.checkpoint())
        io.stats.checkpoints += 1
        for delivery in self._pending:
            try:
                io.broker.ack(delivery)
            except StaleDeliveryError:
                io.stats.stale_acks += 1  # redelivered later, then skipped as a duplicate
        self._pending.clear()
        self._steps_since = 0
        self._dirty = False
