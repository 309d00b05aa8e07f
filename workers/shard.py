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
import time
from collections.abc import Callable
from dataclasses import dataclass

from broker.errors import LeaseNotHeldError, StaleDeliveryError, VersionNotFoundError
from broker.messages import RoundEnd, RoundStart, SmashedBatch
from broker.store import WeightStore
from broker.transport import Broker, Delivery
from services.algorithms.base import Strategy
from services.metrics.recorder import NO_METRICS, Metrics
from workers.async_shard import AsyncShard
from workers.barrier import StepBarrier
from workers.checks import (
    ShardExpectations,
    check_addressing,
    check_batch,
    check_marker,
    check_membership,
    parse_cohort,
)
from workers.deadletter import reject
from workers.replica import Replica
from workers.replies import Replier
from workers.serve import Item, answer_duplicate, serve
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
    # Async mode (docs/async.md): the bound on smashed data's staleness; None in sync mode.
    async_max_staleness: int | None = None


@dataclass
class ShardServices:
    """What a shard needs from its worker: one broker handle, the store, counters."""

    broker: Broker
    store: WeightStore
    strategy: Strategy
    replier: Replier
    stats: WorkerStats
    renew_lease: Callable[[int], bool]
    redeliver: Callable[[int], None]  # return every unacked delivery of a shard, in order
    clock: Callable[[], float]
    logger: logging.Logger
    metrics: Metrics = NO_METRICS
    # Whether the job's coordinator admitted a client (`workers.members.MemberCache`).
    known_client: Callable[[str], bool] = lambda _client: True
    # (lease name, owner) this worker saves checkpoints under; None: unguarded saves.
    lease_holder: Callable[[int], tuple[str, str]] | None = None


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
        self._fold: list[Item] = []
        self._barrier: StepBarrier[Item] = StepBarrier(policy.barrier_timeout_s)
        self._async = self._async_shard()

    @property
    def shard(self) -> int:
        return self.replica.shard

    def buffered(self) -> int:
        """Valid batches received but not applied yet (they go back to the queue on stop)."""
        return len(self._fold) + len(self._barrier)

    def deadline(self) -> float | None:
        return self._barrier.deadline()

    # --- deliveries ---------------------------------------------------------------------------
    def _async_shard(self) -> AsyncShard | None:
        bound = self._policy.async_max_staleness
        if bound is None:
            return None
        io = self._io
        return AsyncShard(self.replica, io.store, self._want.job, bound, io.stats, io.logger)

    def handle(self, delivery: Delivery, message: ShardMessage) -> None:
        if self._async is not None and not isinstance(message, SmashedBatch):
            # Async mode has no rounds: a marker would reset the replica's sample count.
            self._reject(delivery, "no_rounds", f"{type(message).__name__} in async mode")
            return
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
        if problem is None and not self._member(batch.client):
            problem = ("unknown_client", f"client {batch.client!r} is not a member of the job")
        if problem is not None:
            self._reject(delivery, *problem)
            return
        last = replica.last_seq(batch.client)
        if last is not None and batch.seq <= last:
            self._skip_duplicate(delivery, batch)
            return
        if self._replaces_buffered(delivery, batch):
            return
        if self._async is not None and self._async_refused(delivery, batch, self._async):
            return
        newest = replica.version if self._async is None else self._async.known_version
        self._io.metrics.staleness(newest - batch.version)
        if self._async is None and batch.version > replica.version:
            self.settle()
            if not self._reload(batch.version):
                self._reject(delivery, "unknown_version", f"version {batch.version} not found")
                return
        item = Item(delivery, batch)
        if self._io.strategy.server_barrier:
            self._barrier.add(batch.client, item, self._io.clock())
            self._step_barrier(force=False)
        else:
            self._fold.append(item)
            if len(self._fold) >= self._policy.batch_messages:
                self.flush()

    def _async_refused(self, delivery: Delivery, batch: SmashedBatch, mode: AsyncShard) -> bool:
        """Async mode: a batch of an unknown version is dead-lettered, a too stale one
        answered "too_stale" (valid, just too old: acked with the next checkpoint)."""
        unknown = mode.unknown_version(batch)
        if unknown is not None:
            self._reject(delivery, "unknown_version", unknown)
            return True
        stale = mode.too_stale(batch)
        if stale is None:
            return False
        self._hold(delivery)
        mode.refuse(batch, stale, self._io.replier)
        return True

    def _member(self, client: str) -> bool:
        """Cohort members and clients already applied here are known without asking."""
        replica = self.replica
        return client in replica.cohort or client in replica.seqs or self._io.known_client(client)

    def _marker_problem(self, message: RoundStart | RoundEnd) -> tuple[str, str] | None:
        return check_addressing(message, self._want) or check_marker(
            message, self._io.store.current_version(self._want.job)
        )

    def _on_round_start(self, delivery: Delivery, message: RoundStart) -> None:
        marker = self._marker_problem(message)
        if marker is not None:
            self._reject(delivery, *marker)
            return
        cohort, problem = parse_cohort(message, self._want)
        if problem is not None or cohort is None:
            self._reject(delivery, *(problem or ("bad_cohort", "unusable participants")))
            return
        self.settle()
        if message.version > self.replica.version and not self._reload(message.version):
            self._say(
                logging.WARNING,
                "RoundStart %d names unknown version %d",
                message.round,
                message.version,
            )
        if message.round >= self.replica.cohort_round:
            if message.round > self.replica.cohort_round:
                self._barrier.new_round()
            self.replica.begin_round(message.round, cohort)
        self._hold(delivery)

    def _on_round_end(self, delivery: Delivery, message: RoundEnd) -> None:
        problem = self._marker_problem(message)
        if problem is not None:
            self._reject(delivery, *problem)
            return
        # Every batch of the round is ahead of this marker: serve what is still buffered.
        self.settle()
        handed_in = self.replica.end_round(message.round)
        self._hold(delivery)
        self.checkpoint(force=True)
        if handed_in:
            self._say(
                logging.INFO,
                "round %d handed in (%d samples, %d applied in total)",
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
            or (self._async is not None and self._async.due())
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
                self._say(
                    logging.INFO,
                    "round %d: barrier stopped waiting for %s",
                    replica.cohort_round,
                    sorted(self._barrier.dropped),
                )
            self._apply(items)

    def _apply(self, items: list[Item]) -> None:
        io = self._io
        started = time.perf_counter()
        outcome = serve(items, self.replica, io.strategy, io.replier, io.stats)
        if outcome.applied:
            io.metrics.step(time.perf_counter() - started)
            io.metrics.samples(sum(int(i.batch.labels.shape[0]) for i in outcome.applied))
        if outcome.failure is not None:
            self._say(logging.ERROR, "server step failed: %r", outcome.failure)
            for item in items:
                self._reject(item.delivery, "server_step", repr(outcome.failure))
        elif outcome.poisoned:
            self._rollback(outcome.poisoned)
        else:
            self._steps_since += 1
            for item in outcome.applied:
                self._hold(item.delivery)

    def _rollback(self, poisoned: list[Item]) -> None:
        """A non-finite step poisoned the replica: reject the culprits, go back to the last
        checkpoint, and have everything since delivered again, to be applied on the clean state.

        Re-subscribing (not nacking one by one) returns the deliveries in queue order, along
        with the ones prefetched behind them, so seqs still rise and none looks a duplicate."""
        io = self._io
        for item in poisoned:
            self._reject(item.delivery, "non_finite", f"server step on seq {item.batch.seq}")
        returned = len(self._pending) + self.buffered()
        self._pending, self._fold = [], []
        self._barrier.clear()
        io.redeliver(self.shard)
        fresh = self.replica.reset(io.store, self._want.job)
        self._async = self._async_shard()  # measured from the state it went back to
        io.stats.rollbacks += 1
        self._steps_since, self._dirty = 0, False
        self._say(logging.ERROR, "non-finite step; back to %s, %d redelivered", fresh, returned)

    # --- bookkeeping --------------------------------------------------------------------------
    def _replaces_buffered(self, delivery: Delivery, batch: SmashedBatch) -> bool:
        """A copy of a batch still buffered takes the buffered delivery's place; the older
        delivery is held (acked with the next checkpoint) like any duplicate. After a reconnect
        the older one is stale and only the copy can be acked once the batch is applied:
        skipping the copy would lose the batch."""

        def same(item: Item) -> bool:
            return item.batch.client == batch.client and item.batch.seq == batch.seq

        def renewed(item: Item) -> Item:
            return Item(delivery, item.batch)

        older = self._barrier.replace(same, renewed)
        for index, item in enumerate(self._fold):
            if same(item):
                older, self._fold[index] = item, renewed(item)
        if older is None:
            return False
        # No reply: the batch is still to be served, and its answer will follow.
        self._io.stats.duplicates_skipped += 1
        self._hold(older.delivery)
        return True

    def _skip_duplicate(self, delivery: Delivery, batch: SmashedBatch) -> None:
        self._hold(delivery)  # acked with the next checkpoint, never applied again
        answer_duplicate(batch, self.replica.version, self._io.replier, self._io.stats)

    def _reload(self, version: int) -> bool:
        try:
            self.replica.load_version(self._io.store, self._want.job, version)
        except VersionNotFoundError:
            return False
        self._dirty = True
        self._io.stats.reloads += 1
        self._say(logging.INFO, "replica reloaded from version %d", version)
        return True

    def _hold(self, delivery: Delivery) -> None:
        if not self._pending:
            self._pending_since = self._io.clock()
        self._pending.append(delivery)
        self._dirty = True

    def _say(self, level: int, message: str, *args: object) -> None:
        self._io.logger.log(level, "job %s shard %d: " + message, self._want.job, self.shard, *args)

    def _reject(self, delivery: Delivery, code: str, detail: str) -> None:
        reject(self._io.broker, delivery, code, detail, self._io.stats, self._io.logger)

    def checkpoint(self, *, force: bool = False) -> None:
        """Save the replica, then ack what it covers (raises `LeaseLostError`)."""
        if not (force or self._dirty or self._pending):
            return
        io = self._io
        if not io.renew_lease(self.shard):
            raise LeaseLostError(f"shard {self.shard}: lease taken over")
        holder = None if io.lease_holder is None else io.lease_holder(self.shard)
        try:
            if self._async is None:
                io.store.save_checkpoint(self._want.job, self.replica.checkpoint(), holder=holder)
            else:
                self._async.rebase()
                saved = self._async.stamped(self.replica.checkpoint())
                io.store.save_checkpoint(self._want.job, saved, holder=holder)
                self._async.saved(saved)
        except LeaseNotHeldError as exc:
            # The lease ran out before the save landed and another worker may own the shard:
            # its checkpoint stays, our unacked batches are redelivered to it.
            raise LeaseLostError(f"shard {self.shard}: {exc}") from exc
        # The save may have waited out a store outage during which the lease expired and
        # another worker loaded the older checkpoint: acking now would lose these batches.
        if not io.renew_lease(self.shard):
            raise LeaseLostError(f"shard {self.shard}: lease lost while saving the checkpoint")
        io.stats.checkpoints += 1
        for delivery in self._pending:
            try:
                io.broker.ack(delivery)
            except StaleDeliveryError:
                io.stats.stale_acks += 1  # redelivered later, then skipped as a duplicate
        self._pending.clear()
        self._steps_since = 0
        self._dirty = False
