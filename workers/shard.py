"""Everything one held shard does with its deliveries, in the order of architecture step 5.
Deliveries stay unacked until a checkpoint covers them (design §7): a crash loses nothing, and
the checkpoint's seqs make a redelivered batch apply once. A non-finite step has poisoned the
replica: nothing is recorded or answered; it rolls back.

The runner's parts: the checks of a message alone (`workers.shard_checks`), a client's credit
and seq window (`workers.gate`), the step barrier (`workers.barrier`), a deterministic job's
canonical order (`workers.sequencer`), a U-shaped job's open step (`workers.ushaped`) and the
replies (`workers.replies`); what it reaches beyond its replica comes in a `ShardIO`
(`workers.shard_io`).

Determinism (`job.deterministic`, issue 36): in sync rounds a non-barrier algorithm's batches
go through the sequencer, which releases them in one canonical order (round-robin over the
cohort by step) into the fold; barrier algorithms (MiniBatch-SFL) are canonical already, one
step per step index in cohort order. Both still give up on a silent client after
`workers.step_barrier_timeout_s`: the only way past a dead client, and the one point where a
run's order depends on time (the record says what happened). With `workers.batch_messages` > 1
the order is canonical but which released batches share a step still depends on when the
queue ran dry. Async shards (`Continuous`) serve batches as they arrive, for now. A replay's
shard (`splitmq replay`: `ShardIO.scripts`) serves them in the order its run recorded
(`workers.sequencer.RecordedOrder`), free-running runs' included; what the record serves later
or never stays held through a settle.

The schedule: every batch applied is recorded (`Applied`) in the shard's stream; every
checkpoint (`Checkpointed`, with the digest of the weights it holds) and every start from one
(`Restored`: a take-over, a restart, a rollback) too. A free-running job's entries are written
once a server step, before its replies go out, so no reply is ever of an unrecorded
application; a deterministic job's with each checkpoint (one store call per checkpoint, not per
step): a successor re-applies the lost batches in the same canonical order, so the replies
sent before a crash are the ones it computes again.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from functools import partial
from typing import cast

import torch

from broker.errors import LeaseNotHeldError, StaleDeliveryError, VersionNotFoundError
from broker.messages import RoundEnd, RoundStart, SmashedBatch, TailGradient
from broker.rejection import Rejection
from broker.tensors import all_finite
from broker.transport import Delivery
from services.algorithms.base import CohortBatch, StepResults
from services.algorithms.staleness import TOO_STALE
from services.common.checks.addressing import SameJob, SameShard
from services.common.checks.chain import Check, first_rejection
from services.common.checks.markers import MarkerVersion
from services.common.checks.sender import ClientIdShape, ClientSender, NamesClient, ServiceSender
from services.common.leases import lease_name
from services.common.schedule import (
    Applied,
    BatchKey,
    Checkpointed,
    Restored,
    ScheduleLog,
    shard_stream,
    state_digest,
)
from workers.barrier import StepBarrier
from workers.clock import Continuous
from workers.gate import ClientGate, copy_problem, reused
from workers.replica import Replica
from workers.replies import answer
from workers.sequencer import RecordedOrder, Sequencer
from workers.shard_checks import (
    BatchContent,
    CohortMember,
    KnownClient,
    ShardExpectations,
    no_rounds,
    not_u_shaped,
    parse_cohort,
)
from workers.shard_io import Item, ShardIO, ShardLimits
from workers.ushaped import ForwardFailedError, UShapedStep


class LeaseLostError(Exception):
    """Another worker holds this shard's lease now: drop the shard without checkpointing."""


class ShardRunner:
    """One held shard: its replica, the deliveries it holds unacked until a checkpoint, and
    the batches it buffers (a fold, a step barrier, an open U-shaped step)."""

    def __init__(
        self,
        replica: Replica,
        want: ShardExpectations,
        continuous: Continuous | None,
        io: ShardIO,
    ) -> None:
        """`continuous`: an async shard's clock; None in sync rounds (markers drive them)."""
        self.replica = replica
        self.shard = replica.shard
        self._want = want
        self._async = continuous
        self._io = io
        self._server_side = io.server_side
        self._limits = limits = io.limits
        self._pending: list[Delivery] = []  # handled, waiting for a checkpoint to ack them
        self._pending_since = 0.0
        self._steps_since = 0
        self._dirty = False
        self._fold: list[Item] = []
        self._barrier: StepBarrier[Item] | None = (
            StepBarrier(limits.step_timeout_s) if self._server_side.barrier else None
        )
        self._sequencer = self._order(replica, limits, io.scripts.get(self.shard), continuous)
        self._buffers = self._barrier is not None or want.u_shaped
        self._schedule = ScheduleLog(io.store, want.job, shard_stream(self.shard))
        # Local-loss algorithms' clients never wait for the gradient: spare the bytes.
        self._send_grad = self._server_side.waits_for_gradient
        # A U-shaped job's step between its halves; None in any other job.
        self._ushaped = UShapedStep(io, self._hold) if want.u_shaped else None
        self._gate = ClientGate(limits.rule, io.members, replica, by_version=continuous is not None)
        self._batch_checks, self._tail_checks, self._marker_checks = self._chains()
        if replica.from_checkpoint:  # a take-over or a restart: the record goes on from here
            self._restored()

    def _order(
        self,
        replica: Replica,
        limits: ShardLimits,
        script: Sequence[BatchKey] | None,
        continuous: Continuous | None,
    ) -> Sequencer[Item] | RecordedOrder[Item] | None:
        """What orders a sync round's batches of a non-barrier algorithm: a replay's record
        (`script`), else with `job.deterministic` the canonical order; None: arrival order."""
        if self._barrier is not None or continuous is not None:
            return None
        timeout, limit = limits.step_timeout_s, limits.pending_limit
        if script is not None:
            return RecordedOrder(
                script,
                lambda item: (item.batch.client, item.batch.round, item.batch.step),
                lambda: replica.applied,
                timeout,
                limit,
                say=partial(self._say, "%s"),
            )
        return Sequencer(timeout, limit) if limits.deterministic else None

    def _chains(
        self,
    ) -> tuple[
        tuple[Check[SmashedBatch], ...],
        tuple[Check[TailGradient], ...],
        tuple[Check[RoundStart | RoundEnd], ...],
    ]:
        """Each message type's delivery checks, in order: the sender first (as it always was),
        then the addressing, the client id, the content, the cohort and the membership."""
        io, want = self._io, self._want
        sender = ClientSender(io.senders, "impostor")
        addressed = (SameJob(want.job), SameShard(want.shard))
        client_id = (NamesClient("bad_client"), ClientIdShape("bad_client"))
        known = KnownClient(self.replica, io.members)
        batch: tuple[Check[SmashedBatch], ...] = (
            sender,
            *addressed,
            *client_id,
            BatchContent(want),
            CohortMember(self.replica, io.members),
        )
        tail: tuple[Check[TailGradient], ...] = (
            (sender, *addressed, *client_id, known) if want.u_shaped else (sender, not_u_shaped)
        )
        published = partial(io.store.current_version, want.job)
        marker: tuple[Check[RoundStart | RoundEnd], ...] = (
            ServiceSender(io.senders, "impostor"),
            *((no_rounds,) if self._async is not None else ()),
            *addressed,
            MarkerVersion(published),
        )
        return batch, tail, marker

    def buffered(self) -> int:
        """Valid batches received but not applied yet (they go back to the queue on stop)."""
        barred = len(self._barrier) if self._barrier is not None else 0
        held = len(self._sequencer) if self._sequencer is not None else 0
        opened = self._ushaped.held() if self._ushaped is not None else 0
        return len(self._fold) + barred + held + opened

    def wake_at(self) -> float | None:
        """When the worker's loop must come back for this runner: -inf when folded batches
        could be applied now (no U-shaped step is open), else a barrier's, the sequencer's or an
        open step's deadline; None when nothing waits."""
        if self._fold and not (self._ushaped is not None and self._ushaped.is_open):
            return -math.inf
        if self._barrier is None and self._ushaped is None:
            # The sequencer's deadline is an attribute: no call on the path.
            return self._sequencer.due_at if self._sequencer is not None else None
        return self.deadline()

    def deadline(self) -> float | None:
        times = [self._barrier.deadline() if self._barrier is not None else None]
        times.append(self._ushaped.deadline() if self._ushaped is not None else None)
        times.append(self._sequencer.due_at if self._sequencer is not None else None)
        return min((t for t in times if t is not None), default=None)

    # --- deliveries ---------------------------------------------------------------------------
    def on_batch(self, delivery: Delivery, batch: SmashedBatch) -> None:
        """The batch chain's checks; then its seq (a copy of a batch applied or buffered, or a
        seq outside its session's window: `workers.gate`), the async clock and its client's
        credit; then it is buffered or applied. Inline, not in helpers: every batch runs it."""
        replica, io, gate = self.replica, self._io, self._gate
        for check in self._batch_checks:
            if (problem := check(delivery, batch)) is not None:
                io.refuse(delivery, problem.reason)
                return
        if replica.applied_already(batch.client, batch.seq):
            self._copy_of_applied(delivery, batch)
            return
        if (outside := gate.seq_problem(batch)) is not None:
            io.refuse(delivery, outside.reason)
            return
        # Only a runner that buffers can hold a copy of `batch` (the sequencer: only while it
        # holds one, read without a call).
        sequencer = self._sequencer
        buffers = self._fold or self._buffers or (sequencer is not None and sequencer.held)
        if buffers and self._replaces_buffered(delivery, batch):
            return
        clock = self._async
        if clock is not None and self._refused_by_clock(delivery, batch, clock):
            return
        if (over := gate.take(batch)) is not None:
            io.refuse(delivery, over.reason)
            return
        if io.metrics.enabled:
            newest = replica.version if clock is None else clock.known_version
            io.metrics.staleness(newest - batch.version)
        if clock is None and batch.version > replica.version and not self._move_to(delivery, batch):
            return
        item = Item(delivery, batch)
        if self._barrier is not None:
            self._barrier.add(batch.client, item, io.clock())
            self._step_barrier(force=False)
            return
        fold = self._fold
        # The sequencer's: its turn in the canonical order may not have come, and earlier
        # ones may go now (a batch is "ordered" when it is of the cohort's round).
        fold += (
            [item]
            if sequencer is None
            else sequencer.offer(
                batch.client,
                batch.step,
                batch.steps,
                item,
                batch.round == replica.cohort_round and batch.client in replica.cohort,
                replica.cohort,
                replica.progress,
                io.clock(),
            )
        )
        if len(fold) >= self._limits.batch_messages:
            self.flush()

    def _answer_unrecorded(self, refused: list[Item]) -> None:
        """A replay's batches that the run never applied: answered "rejected", never applied
        (acked with the next checkpoint); their client ends its round, as the run's had."""
        while refused:
            item = refused.pop()
            self._hold(item.delivery)
            detail = "not in the replayed run's record: the run never applied this batch"
            self._io.replier.send(answer(item.batch, self.replica.version, "rejected", detail))

    def _move_to(self, delivery: Delivery, batch: SmashedBatch) -> bool:
        """Sync rounds: serve what is buffered, then load the newer version `batch` was
        computed with; False (`batch` dead-lettered) when there is no such version."""
        self.settle()
        if self._reload(batch.version):
            return True
        detail = f"version {batch.version} not found"
        self._io.refuse(delivery, Rejection("unknown_version", detail).reason)
        return False

    def _copy_of_applied(self, delivery: Delivery, batch: SmashedBatch) -> None:
        """A copy of a batch applied already is answered, never applied again; a message
        reusing its seq under another message id is dead-lettered."""
        recorded = self.replica.applied_id(batch.client, batch.seq)
        if (forged := copy_problem(batch.seq, batch.message_id, recorded)) is not None:
            self._io.refuse(delivery, forged.reason)
            return
        self._hold(delivery)  # acked with the next checkpoint, never applied again
        self._answer_duplicate(batch)

    def _refused_by_clock(self, delivery: Delivery, batch: SmashedBatch, clock: Continuous) -> bool:
        """Async mode: whether `batch`'s version is unknown (dead-lettered) or too stale to
        train on (answered)."""
        io = self._io
        self._gate.forget_versions_before(clock.known_version - clock.max_staleness)
        refused = clock.refusal(batch)
        if refused is None:
            return False
        if refused.code != TOO_STALE:
            io.refuse(delivery, refused.reason)
            return True
        # Valid, just too old: answered, and acked with the next checkpoint.
        self._hold(delivery)
        io.stats.too_stale += 1
        io.replier.send(answer(batch, clock.known_version, "rejected", refused.detail))
        return True

    def on_tail(self, delivery: Delivery, message: TailGradient) -> None:
        """A client's dL/d(ServerOutput): finishes its open step (docs/architecture.md,
        "U-shaped split"); a copy of one applied already is answered as a batch's copy is."""
        problem = first_rejection(self._tail_checks, delivery, message)
        if problem is not None or self._ushaped is None:
            self._io.refuse(delivery, (problem or not_u_shaped(delivery, message)).reason)
            return
        if self.replica.applied_already(message.client, message.seq):
            self._hold(delivery)
            self._answer_duplicate(message)
            return
        if self._ushaped.take(delivery, message):
            self._finish(force=False)

    def on_marker(self, delivery: Delivery, message: RoundStart | RoundEnd) -> None:
        problem = first_rejection(self._marker_checks, delivery, message)
        if problem is not None:
            self._io.refuse(delivery, problem.reason)
        elif isinstance(message, RoundStart):
            self._on_round_start(delivery, message)
        else:
            self._on_round_end(delivery, message)

    def _on_round_start(self, delivery: Delivery, message: RoundStart) -> None:
        cohort, problem = parse_cohort(message)
        if problem is not None or cohort is None:
            problem = problem or Rejection("bad_cohort", "unusable participants")
            self._io.refuse(delivery, problem.reason)
            return
        self.settle()
        if message.version > self.replica.version and not self._reload(message.version):
            args = (message.round, message.version)
            self._say("RoundStart %d names unknown version %d", *args, level=logging.WARNING)
        if message.round >= self.replica.cohort_round:
            if message.round > self.replica.cohort_round and self._barrier is not None:
                self._barrier.new_round()
            if message.round > self.replica.cohort_round and self._sequencer is not None:
                self._sequencer.new_round()
            self.replica.begin_round(message.round, cohort)
            self._gate.new_round()
        self._hold(delivery)

    def _on_round_end(self, delivery: Delivery, message: RoundEnd) -> None:
        # Every batch of the round is ahead of this marker: serve what is still buffered.
        self.settle()
        handed_in = self.replica.end_round(message.round)
        self._hold(delivery)
        self.checkpoint(force=True)
        if handed_in:
            args = (message.round + 1, self.replica.round_samples, self.replica.applied)
            self._say("round %d handed in (%d samples, %d applied in total)", *args)
            self.replica.start_counting()

    # --- stepping -----------------------------------------------------------------------------
    def flush(self) -> None:
        """Apply folded batches now (the queue had nothing more to fold with them)."""
        if self._fold and not (self._ushaped is not None and self._ushaped.is_open):
            # At most one fold's worth: while a U-shaped step was open, more may have queued.
            n = self._limits.batch_messages
            items, self._fold = self._fold[:n], self._fold[n:]
            self._apply(items)

    def settle(self) -> None:
        """Serve every buffered batch: before a round marker or a version change. An open
        U-shaped step goes on with the tail gradients it has (a straggler's, whose round
        closed without it)."""
        while self.buffered():
            self._finish(force=True)
            self.flush()
            self._step_barrier(force=True)
            self._sequence(force=True)
            if self._sequencer is not None and self.buffered() == self._sequencer.held:
                return  # a replay's: only batches the record serves later (or never) are left

    def poll(self, *, idle: bool = False) -> None:
        """Time-driven work: a barrier or an open step past its timeout, a due checkpoint;
        `idle` (the queue had nothing more): the folded batches are applied first."""
        if idle:
            self.flush()
        if self._ushaped is not None and self._ushaped.due():
            self._finish(force=True)
        if self._barrier is not None:
            self._step_barrier(force=False)
        sequencer = self._sequencer
        if sequencer is not None and sequencer.refused:  # a replay's, never a run's
            self._answer_unrecorded(sequencer.refused)
        if sequencer is not None and sequencer.due_at is not None:
            waiting = sequencer.waiting_for
            if waiting is not None and not self._io.members(waiting):
                # It left the job (a Leave, or its membership expired): no batch of its will
                # come, and the others need not wait out the timeout for it.
                sequencer.skip(waiting)
                self._sequence(force=False)
            elif self._io.clock() >= sequencer.due_at:
                self._sequence(force=False)
        limits = self._limits
        if self._pending and (
            self._steps_since >= limits.checkpoint_every_steps
            or len(self._pending) >= limits.pending_limit
            or self._io.clock() - self._pending_since >= limits.checkpoint_every_s
            or (self._async is not None and self._async.due())
        ):
            self.checkpoint()

    def _step_barrier(self, *, force: bool) -> None:
        barrier, replica = self._barrier, self.replica
        if barrier is None or (self._ushaped is not None and self._ushaped.is_open):
            return
        while (
            len(barrier)
            and not (self._ushaped is not None and self._ushaped.is_open)
            and (
                force
                or barrier.ready(replica.cohort, replica.progress)
                or barrier.expired(self._io.clock())
            )
        ):
            items = barrier.take(replica.cohort, replica.progress)
            if barrier.dropped:
                args = (replica.cohort_round + 1, sorted(barrier.dropped))
                self._say("round %d: barrier stopped waiting for %s", *args)
            self._apply(items)

    def _sequence(self, *, force: bool) -> None:
        """What the sequencer lets go now (`force`: all it holds, in canonical order) joins the
        fold; a client whose turn kept the others waiting too long is skipped."""
        sequencer, replica = self._sequencer, self.replica
        if sequencer is None:
            return
        skipped = len(sequencer.skipped)
        if force:
            released = sequencer.settle(replica.cohort, replica.progress)
        else:
            released = sequencer.take(replica.cohort, replica.progress, self._io.clock())
        if len(sequencer.skipped) > skipped:
            args = (replica.cohort_round + 1, sorted(sequencer.skipped))
            self._say("round %d: the canonical order goes on without %s", *args)
        self._fold += released

    def _apply(self, items: list[Item]) -> None:
        if self._ushaped is not None:
            self._open_step(self._ushaped, items)
            return
        io, replica = self._io, self.replica
        started = time.perf_counter()
        cohort_round, cohort = replica.cohort_round, replica.cohort
        # `BatchContent` let a batch without labels through in a U-shaped job only; the weight
        # is the cohort's samples, else the batch's rows, inline.
        batches = []
        for item in items:
            b = item.batch
            in_cohort = b.round == cohort_round and b.client in cohort
            weight = float(cohort[b.client] if in_cohort else b.activations.shape[0])
            labels = cast(torch.Tensor, b.labels)
            batches.append(CohortBatch(b.client, b.activations, labels, weight, cut=b.cut))
        try:
            results = self._server_side.step(
                replica.server, replica.optimizer, batches, loss=io.loss
            )
        except Exception as exc:  # never let one step take the worker down
            self._step_failed("step", items, exc)
            return
        # all_finite: numpy's scan on this thread, much cheaper here than torch's OpenMP pool.
        if not all(math.isfinite(loss) and all_finite(g) for g, loss, _ in results):
            # The batches whose own loss was not finite (all, if none was singled out); the
            # others of the step are retried on a clean replica.
            bad = [
                i for i, (_, loss, _) in zip(items, results, strict=True) if not math.isfinite(loss)
            ]
            self._rollback(bad or items)
            return
        self._answer_step(items, results, started)

    def _answer_step(self, items: list[Item], results: StepResults, started: float) -> None:
        """Record a step taken on `items` and send each its GradientReply."""
        io, replica, schedule = self._io, self.replica, self._schedule
        replica.steps += 1
        io.stats.steps += 1
        self._steps_since += 1
        rows_total = 0
        version, step_no, worker = replica.version, replica.steps, io.worker_id
        for item in items:
            b = item.batch
            rows = int(b.activations.shape[0])
            rows_total += rows
            replica.record(b.client, b.seq, b.step, b.steps, rows, b.cut, b.message_id)
            position = replica.applied
            entry = Applied(
                self.shard, b.client, b.round, b.step, version, position, step_no, worker
            )
            schedule.pending.append(entry)  # `add`, inline: every batch runs it
            # `_hold`, inline.
            if not self._pending:
                self._pending_since = io.clock()
            self._pending.append(item.delivery)
            self._dirty = True
        if not self._limits.deterministic:
            # Written before any reply goes out: a reply is never of an unrecorded
            # application, whatever order the batches came in. A deterministic job's entries
            # wait for the next checkpoint: should this worker die first, its successor
            # applies the same batches again from that checkpoint in the same canonical
            # order, so the gradients already sent are the ones it computes again.
            schedule.flush()
        for item, (grad, loss, correct) in zip(items, results, strict=True):
            b = item.batch
            reply = answer(
                b,
                replica.version,
                "ok",
                loss=loss,
                correct=correct,
                grad=io.plane.host(grad, b.activations.dtype) if self._send_grad else None,
            )
            if io.replier.send(reply):
                io.stats.replies += 1
            else:
                io.stats.replies_undeliverable += 1
        io.stats.batches_applied += len(items)
        if io.metrics.enabled:
            io.metrics.step(time.perf_counter() - started)
            io.metrics.samples(rows_total)

    def _step_failed(self, what: str, items: list[Item], exc: Exception) -> None:
        self._say("server %s failed: %r", what, exc, level=logging.ERROR)
        for item in items:
            self._io.refuse(item.delivery, Rejection("server_step", repr(exc)).reason)

    def _cohort_weight(self, batch: SmashedBatch) -> float:
        """MiniBatch-SFL's p_n: the client's samples from RoundStart; its rows otherwise."""
        replica = self.replica
        if batch.round == replica.cohort_round and batch.client in replica.cohort:
            return float(replica.cohort[batch.client])
        return float(batch.activations.shape[0])

    # --- U-shaped steps -----------------------------------------------------------------------
    def _open_step(self, ushaped: UShapedStep, items: list[Item]) -> None:
        """The forward half (`workers.ushaped`)."""
        try:
            opened = ushaped.forward(
                self.replica, items, [self._cohort_weight(i.batch) for i in items]
            )
        except ForwardFailedError as failed:  # never let one step take the worker down
            self._step_failed("forward", items, failed.cause)
            return
        if not opened:
            self._rollback(items)
            return
        self._finish(force=False)

    def _finish(self, *, force: bool) -> None:
        """The backward half, once every batch's tail gradient is in (`force`: with those
        that are; a batch without one is answered "rejected", never applied)."""
        ushaped = self._ushaped
        done = ushaped.backward(self.replica, force=force) if ushaped is not None else None
        if ushaped is None or done is None:
            return
        if done.error is not None:
            self._say("server backward failed: %r", done.error, level=logging.ERROR)
        if done.poisoned:
            self._rollback(done.poisoned)
            return
        if done.present:
            self._answer_step(done.present, done.grads, done.started)
        ushaped.turn_away(done.missing, self.replica.version)
        self._step_barrier(force=False)
        if len(self._fold) >= self._limits.batch_messages:
            self.flush()

    def _rollback(self, poisoned: list[Item]) -> None:
        """A non-finite step poisoned the replica: reject the culprits, go back to the last
        checkpoint, and have everything since delivered again, to be applied on the clean state.

        Re-subscribing (not nacking one by one) returns the deliveries in queue order, along
        with the ones prefetched behind them, so seqs still rise and none looks a duplicate."""
        io = self._io
        for item in poisoned:
            detail = f"server step on seq {item.batch.seq}"
            self._io.refuse(item.delivery, Rejection("non_finite", detail).reason)
        returned = len(self._pending) + self.buffered()
        self._pending, self._fold = [], []
        if self._ushaped is not None:
            self._ushaped.clear()
        if self._barrier is not None:
            self._barrier.clear()
        if self._sequencer is not None:
            self._sequencer.clear()  # the replica's restored progress says where the round is
        io.redeliver(self.shard)
        fresh = self.replica.reset(io.store, self._want.job)
        self._restored()  # the batches recorded since its checkpoint are undone
        self._gate.reset()
        if self._async is not None:
            self._async.restart()  # measured from the state it went back to
        io.stats.rollbacks += 1
        self._steps_since, self._dirty = 0, False
        self._say(
            "non-finite step; back to %s, %d redelivered", fresh, returned, level=logging.ERROR
        )

    # --- bookkeeping --------------------------------------------------------------------------
    def _replaces_buffered(self, delivery: Delivery, batch: SmashedBatch) -> bool:
        """A copy of a batch still buffered takes the buffered delivery's place; the older
        delivery is held (acked with the next checkpoint) like any duplicate. After a reconnect
        the older one is stale and only the copy can be acked once the batch is applied:
        skipping the copy would lose the batch."""
        if not self.buffered():
            return False

        taken_from: list[str] = []  # a buffered batch's message id, when `batch` is not its copy

        def same(item: Item) -> bool:
            if item.batch.client != batch.client or item.batch.seq != batch.seq:
                return False
            if item.batch.message_id != batch.message_id:
                taken_from.append(item.batch.message_id)
                return False
            return True

        def renewed(item: Item) -> Item:
            return Item(delivery, item.batch)

        ushaped = self._ushaped
        opened = ushaped.item(batch.client, batch.seq) if ushaped is not None else None
        if ushaped is not None and opened is not None and same(opened):
            # Its step is open: the client missed the ServerOutput (replies are transient).
            self._io.stats.duplicates_skipped += 1
            self._hold(opened.delivery)
            ushaped.resend(delivery, batch)
            return True

        older = self._barrier.replace(same, renewed) if self._barrier is not None else None
        if older is None and self._sequencer is not None:
            older = self._sequencer.replace(same, renewed)
        for index, item in enumerate(self._fold):
            if same(item):
                older, self._fold[index] = item, renewed(item)
        if older is None and taken_from:
            reuse = reused(batch.seq, batch.message_id, taken_from[0])
            self._io.refuse(delivery, reuse.reason)
            return True
        if older is None:
            return False
        # No reply: the batch is still to be served, and its answer will follow.
        self._io.stats.duplicates_skipped += 1
        self._hold(older.delivery)
        return True

    def _answer_duplicate(self, batch: SmashedBatch | TailGradient) -> None:
        """Answer a copy of a batch applied already, never applying it again: the kept reply, or
        "gone" (docs/architecture.md, "Conventions the roles share")."""
        stats, replier = self._io.stats, self._io.replier
        stats.duplicates_skipped += 1
        resent = replier.resend(batch.job, batch.client, batch.seq)
        if resent is not None:
            stats.replies_resent += resent
            return
        reason = f"duplicate: seq {batch.seq} was already applied; its gradient is no longer kept"
        if replier.send(answer(batch, self.replica.version, "gone", reason)):
            stats.gone_replies += 1

    def _restored(self) -> None:
        """Record that the replica (re)starts from its checkpoint (or, after a rollback with
        none, from its version: position 0)."""
        replica = self.replica
        entry = Restored(self.shard, replica.applied, replica.version, self._io.worker_id)
        self._schedule.add(entry)
        self._schedule.flush()

    def _reload(self, version: int) -> bool:
        try:
            self.replica.load_version(self._io.store, self._want.job, version)
        except VersionNotFoundError:
            return False
        self._dirty = True
        self._io.stats.reloads += 1
        self._say("replica reloaded from version %d", version)
        return True

    def _hold(self, delivery: Delivery) -> None:
        if not self._pending:
            self._pending_since = self._io.clock()
        self._pending.append(delivery)
        self._dirty = True

    def _say(self, message: str, *args: object, level: int = logging.INFO) -> None:
        self._io.log.log(level, "job %s shard %d: " + message, self._want.job, self.shard, *args)

    def checkpoint(self, *, force: bool = False) -> None:
        """Save the replica, then ack what it covers (raises `LeaseLostError`)."""
        if not (force or self._dirty or self._pending):
            return
        io = self._io
        if not io.renew(self.shard):
            raise LeaseLostError(f"shard {self.shard}: lease taken over")
        holder = (lease_name(self.shard), io.worker_id)
        try:
            # An open U-shaped step is not in the checkpoint: the replica as before its forward.
            buffers = self._ushaped.buffers() if self._ushaped is not None else None
            saved = self.replica.checkpoint(buffers) if self._async is None else self._async.save()
            io.store.save_checkpoint(self._want.job, saved, holder=holder)
        except LeaseNotHeldError as exc:
            # The lease ran out before the save landed and another worker may own the shard:
            # its checkpoint stays, our unacked batches are redelivered to it.
            raise LeaseLostError(f"shard {self.shard}: {exc}") from exc
        if self._async is not None:
            self._async.saved(saved)
        self._checkpointed(buffers)
        # The save may have waited out a store outage during which the lease expired and
        # another worker loaded the older checkpoint: acking now would lose these batches.
        if not io.renew(self.shard):
            raise LeaseLostError(f"shard {self.shard}: lease lost while saving the checkpoint")
        io.stats.checkpoints += 1
        for delivery in self._pending:
            try:
                io.ack(delivery)
            except StaleDeliveryError:
                io.stats.stale_acks += 1  # redelivered later, then skipped as a duplicate
        self._pending.clear()
        self._steps_since = 0
        self._dirty = False

    def _checkpointed(self, buffers: dict[str, torch.Tensor] | None) -> None:
        """Record a checkpoint just saved: the batches it covers and its weights' digest (a
        replay that reaches another state there has diverged). Recorded once saved, before
        its deliveries are acked: a checkpoint of which the record knows nothing can only be
        one whose worker died before acking, and its successor's `Restored` names it."""
        replica = self.replica
        state = replica.server.state_dict()
        digest = state_digest({**state, **buffers} if buffers else state)
        worker = self._io.worker_id
        self._schedule.add(
            Checkpointed(self.shard, replica.applied, replica.version, digest, worker)
        )
        self._schedule.flush()
