"""The `SmashedChannel` over the broker: SmashedBatch out to the shard, GradientReply back.

Replies are matched by `seq`. A reply for an earlier seq is a duplicate (a worker answering a
redelivered or republished copy of a batch the client already got an answer for) and is
dropped; one for a seq this client never sent (at or past its next seq) is dead-lettered, wherever
it arrives (`SeqBook.reply_problem`, a validator of the link). A batch with no answer after
`reply_timeout_s` is published again with the same seq; a worker that had applied it answers
the copy with the reply it sent (a lost reply costs one timeout), or, where it no longer has
that gradient (another worker applied the batch before a failover), with status "gone": the
round cannot go on without it, and is dropped at once. "stale" (held, the answer is coming)
keeps the client waiting. After `max_republish` copies without an answer the round is given
up.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from broker.codec import encode
from broker.errors import EncodeError, MessageTooLargeError
from broker.messages import (
    Error,
    GradientReply,
    Message,
    SmashedBatch,
    WeightsAssignment,
    new_message_id,
)
from broker.topology import SMASHED_EXCHANGE, shard_routing_key
from services.algorithms.staleness import TOO_STALE
from services.client.errors import ClientError, RoundAborted, StaleWeights, Superseded
from services.client.link import ClientLink
from services.client.stats import ClientStats


@dataclass
class SeqBook:
    """The client's seq counter and the seqs sent without waiting (across rounds)."""

    next_seq: int
    unawaited: set[int] = field(default_factory=set)

    def take(self) -> int:
        seq = self.next_seq
        self.next_seq += 1
        return seq

    def reply_problem(self, message: Message) -> str | None:
        """Why a GradientReply cannot be an answer to this client, or None. Seqs only grow:
        one at or past `next_seq` was never sent. (An earlier one may be a late copy of an
        answer already taken, or a previous run's: a duplicate, not an invalid message.)"""
        if isinstance(message, GradientReply) and message.seq >= self.next_seq:
            return (
                f"GradientReply for seq {message.seq}, never sent by this client "
                f"(its next seq is {self.next_seq})"
            )
        return None


@dataclass(frozen=True)
class RoundContext:
    """What every SmashedBatch of one round carries."""

    job: str
    client: str
    round: int
    version: int
    shard: int
    wire_dtype: torch.dtype
    cut: str = ""  # where the client's activations come from (its Welcome's cut)


@dataclass
class Tally:
    """Training loss/accuracy as the worker reports it (or the client measures it)."""

    loss_sum: float = 0.0
    correct: int = 0
    samples: int = 0

    def add(self, loss: float, correct: int, samples: int) -> None:
        self.loss_sum += loss * samples
        self.correct += correct
        self.samples += samples

    def metrics(self) -> dict[str, float]:
        if not self.samples:
            return {}
        return {
            "train_loss": self.loss_sum / self.samples,
            "train_accuracy": self.correct / self.samples,
        }


class BrokerChannel:
    """One round's `SmashedChannel` (services.algorithms.base)."""

    def __init__(
        self,
        link: ClientLink,
        context: RoundContext,
        seqs: SeqBook,
        *,
        reply_timeout_s: float,
        max_republish: int,
        stats: ClientStats,
        clock: Callable[[], float],
        logger: logging.Logger,
    ) -> None:
        self._link = link
        self._ctx = context
        self._seqs = seqs
        self._reply_timeout_s = reply_timeout_s
        self._max_republish = max_republish
        self._stats = stats
        self._clock = clock
        self._log = logger
        self._routing_key = shard_routing_key(context.job, context.shard)
        self.tally = Tally()

    def exchange(self, z: torch.Tensor, y: torch.Tensor, step: int, steps: int) -> torch.Tensor:
        batch, body = self._publish(z, y, step, steps)
        return self._await(batch, body, tuple(z.shape))

    def send(self, z: torch.Tensor, y: torch.Tensor, step: int, steps: int) -> None:
        batch, _ = self._publish(z, y, step, steps)
        self._seqs.unawaited.add(batch.seq)

    # --- internals -------------------------------------------------------------------------------

    def _publish(
        self, z: torch.Tensor, y: torch.Tensor, step: int, steps: int
    ) -> tuple[SmashedBatch, bytes]:
        ctx = self._ctx
        batch = SmashedBatch(
            job=ctx.job,
            client=ctx.client,
            message_id=new_message_id(),
            version=ctx.version,
            seq=self._seqs.take(),
            shard=ctx.shard,
            round=ctx.round,
            step=step,
            steps=steps,
            activations=z.detach().to(device="cpu", dtype=ctx.wire_dtype),
            labels=y.detach().to(device="cpu", dtype=torch.int64),
            cut=ctx.cut,
        )
        try:
            body = encode(batch)
        except EncodeError as exc:  # non-finite activations: the local model diverged
            raise RoundAborted(f"step {step}: cannot send smashed data: {exc}") from None
        try:
            self._link.publish(
                SMASHED_EXCHANGE, self._routing_key, body, message_id=batch.message_id
            )
        except MessageTooLargeError as exc:
            raise ClientError(
                f"job {ctx.job} client {ctx.client}: one smashed batch is {len(body)} bytes, "
                f"more than the broker takes ({exc}); lower algorithm.batch_size, use "
                "smashed_dtype float16, or raise broker.max_message_bytes with the server limit"
            ) from None
        self._stats.batches_sent += 1
        return batch, body

    def _await(self, batch: SmashedBatch, body: bytes, shape: tuple[int, ...]) -> torch.Tensor:
        def check(message: Message) -> str | None:
            if (
                isinstance(message, GradientReply)
                and message.seq == batch.seq
                and message.status == "ok"
                and (message.grad is None or tuple(message.grad.shape) != shape)
            ):
                got = None if message.grad is None else list(message.grad.shape)
                return (
                    f"GradientReply seq {batch.seq}: gradient shape {got}, expected {list(shape)}"
                )
            return None

        deadline = self._clock() + self._reply_timeout_s
        republished = 0
        while True:
            message = self._link.poll(max(0.0, deadline - self._clock()), check=check)
            if message is None:
                if self._clock() >= deadline:
                    if republished >= self._max_republish:
                        raise RoundAborted(
                            f"round {self._ctx.round}: no gradient for seq {batch.seq} after "
                            f"{republished + 1} tries of {self._reply_timeout_s:.1f} s"
                        )
                    republished += 1
                    self._republish(batch, body)
                    deadline = self._clock() + self._reply_timeout_s
                continue
            if isinstance(message, GradientReply):
                grad = self._on_reply(message, batch)
                if grad is not None:
                    return grad
            else:
                self._on_other(message, batch)

    def _on_reply(self, reply: GradientReply, batch: SmashedBatch) -> torch.Tensor | None:
        if reply.seq != batch.seq:
            if reply.seq in self._seqs.unawaited:
                self._count(reply)
            else:
                self._stats.duplicates_dropped += 1
                self._log.debug(
                    "job %s client %s: dropped GradientReply seq %d (awaiting %d)",
                    self._ctx.job,
                    self._ctx.client,
                    reply.seq,
                    batch.seq,
                )
            return None
        if reply.status == "stale":
            # The worker holds this seq (e.g. in MiniBatch-SFL's step barrier) and saw our
            # republished copy: its real answer is on the way.
            self._stats.stale_replies += 1
            return None
        if reply.status == "gone":
            # Applied, but no worker has its gradient any more: no wait brings it. The batch
            # counts on the server side; the client side cannot take this step, and every
            # algorithm that waits needs it, so the round ends here (and says so at once).
            self._stats.gone_replies += 1
            raise RoundAborted(
                f"round {self._ctx.round} step {batch.step}: shard {self._ctx.shard} applied "
                f"seq {batch.seq}, its gradient is gone: {reply.reason or 'no reason'}"
            )
        if reply.status == "rejected" and reply.reason.startswith(TOO_STALE):
            raise StaleWeights(f"round {self._ctx.round}: {reply.reason}")
        if reply.status != "ok":
            raise RoundAborted(
                f"round {self._ctx.round} step {batch.step}: shard {self._ctx.shard} answered "
                f"seq {batch.seq} with status {reply.status!r}: {reply.reason or 'no reason'}"
            )
        self._count(reply)
        assert reply.grad is not None  # the check refused an ok reply without one
        return reply.grad

    def _count(self, reply: GradientReply) -> None:
        self._seqs.unawaited.discard(reply.seq)
        self._stats.replies_received += 1
        if reply.status == "ok":
            self.tally.add(reply.loss, reply.correct, reply.samples)

    def _on_other(self, message: Message, batch: SmashedBatch) -> None:
        """Replies for the main loop wait; one that ends this round ends it now."""
        self._link.defer(message)
        if isinstance(message, WeightsAssignment) and (
            message.round > self._ctx.round or not message.participate
        ):
            raise Superseded(
                f"round {self._ctx.round} superseded by an assignment for round {message.round}"
            )
        if isinstance(message, Error) and message.ref_message_id == batch.message_id:
            raise RoundAborted(f"seq {batch.seq} refused: {message.code}: {message.reason}")

    def _republish(self, batch: SmashedBatch, body: bytes) -> None:
        self._stats.republished += 1
        self._log.warning(
            "job %s client %s: no gradient for seq %d (round %d step %d) after %.1f s; "
            "publishing it again",
            self._ctx.job,
            self._ctx.client,
            batch.seq,
            batch.round,
            batch.step,
            self._reply_timeout_s,
        )
        self._link.publish(SMASHED_EXCHANGE, self._routing_key, body, message_id=batch.message_id)
