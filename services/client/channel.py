"""A round's `SmashedChannel` (services.algorithms.base) over the client's `ClientLink`
(`BrokerChannel`): SmashedBatch out to the shard, GradientReply back, each batch published
again while its answer does not come (docs/architecture.md, "Conventions the roles share").
A U-shaped job's channel trades four messages per step instead (docs/architecture.md,
"U-shaped split"): SmashedBatch without labels out, ServerOutput back, TailGradient out,
GradientReply back. `Tally` sums what the replies report of the round's training.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from broker.codec import encode
from broker.errors import EncodeError, MessageTooLargeError
from broker.messages import (
    Error,
    GradientReply,
    Message,
    ServerOutput,
    SmashedBatch,
    TailGradient,
    WeightsAssignment,
    new_message_id,
)
from broker.topology import SMASHED_EXCHANGE, shard_routing_key
from services.algorithms.staleness import TOO_STALE
from services.client.errors import ClientError, RoundAborted, StaleWeights, Superseded
from services.client.link import ClientLink


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
    """One round's `SmashedChannel` (services.algorithms.base): SmashedBatch out to the shard,
    GradientReply back."""

    def __init__(
        self,
        link: ClientLink,
        assignment: WeightsAssignment,
        *,
        shard: int,
        cut: str,
        wire_dtype: torch.dtype,
    ) -> None:
        self._link = link
        self._round = assignment.round
        self._version = assignment.version
        self._shard = shard
        self._cut = cut  # where the client's activations come from (its Welcome's cut)
        self._wire_dtype = wire_dtype
        self._routing_key = shard_routing_key(link.job, shard)
        self.tally = Tally()
        # U-shaped: the batch whose ServerOutput came back and whose tail gradient is due.
        self._forwarded: tuple[SmashedBatch, bytes] | None = None

    def exchange(self, z: torch.Tensor, y: torch.Tensor, step: int, steps: int) -> torch.Tensor:
        batch, body = self._publish(z, y, step, steps)
        return self._await(batch, [(body, batch.message_id)])

    def send(self, z: torch.Tensor, y: torch.Tensor, step: int, steps: int) -> None:
        batch, _ = self._publish(z, y, step, steps)
        self._link.unawaited.add(batch.seq)

    def forward(self, z: torch.Tensor, step: int, steps: int) -> torch.Tensor:
        batch, body = self._publish(z, None, step, steps)
        self._forwarded = (batch, body)
        return self._await(batch, [(body, batch.message_id)], output=True)

    def backward(self, grad: torch.Tensor) -> torch.Tensor:
        if self._forwarded is None:
            raise RuntimeError("backward without a forward: nothing awaits a tail gradient")
        (batch, body), self._forwarded = self._forwarded, None
        link = self._link
        tail = TailGradient(
            job=link.job,
            client=link.client,
            message_id=new_message_id(),
            version=self._version,
            seq=batch.seq,
            shard=self._shard,
            round=self._round,
            grad=grad.detach().to(device="cpu", dtype=self._wire_dtype),
        )
        try:
            tail_body = encode(tail)
        except EncodeError as exc:  # a non-finite loss: the tail diverged
            raise RoundAborted(f"step {batch.step}: cannot send the tail gradient: {exc}") from None
        link.publish(SMASHED_EXCHANGE, self._routing_key, tail_body, message_id=tail.message_id)
        # Unanswered, both go again: a worker that took the shard over may lack the forward.
        copies = [(body, batch.message_id), (tail_body, tail.message_id)]
        return self._await(batch, copies, tally=False)

    def _publish(
        self, z: torch.Tensor, y: torch.Tensor | None, step: int, steps: int
    ) -> tuple[SmashedBatch, bytes]:
        link = self._link
        batch = SmashedBatch(
            job=link.job,
            client=link.client,
            message_id=new_message_id(),
            version=self._version,
            seq=link.next_seq,
            shard=self._shard,
            round=self._round,
            step=step,
            steps=steps,
            activations=z.detach().to(device="cpu", dtype=self._wire_dtype),
            labels=None if y is None else y.detach().to(device="cpu", dtype=torch.int64),
            cut=self._cut,
        )
        link.next_seq += 1
        try:
            body = encode(batch)
        except EncodeError as exc:  # non-finite activations: the local model diverged
            raise RoundAborted(f"step {step}: cannot send smashed data: {exc}") from None
        try:
            link.publish(SMASHED_EXCHANGE, self._routing_key, body, message_id=batch.message_id)
        except MessageTooLargeError as exc:
            raise ClientError(
                f"job {link.job} client {link.client}: one smashed batch is {len(body)} bytes, "
                f"more than the broker takes ({exc}); lower algorithm.batch_size, use "
                "smashed_dtype float16, or raise broker.max_message_bytes with the server limit"
            ) from None
        link.stats.batches_sent += 1
        return batch, body

    def _await(
        self,
        batch: SmashedBatch,
        copies: list[tuple[bytes, str]],
        *,
        output: bool = False,
        tally: bool = True,
    ) -> torch.Tensor:
        """The gradient for `batch` (`output`: the server's output for it, U-shaped), with
        `copies` (body, message id) published again while it does not come."""
        link = self._link
        deadline = link.clock() + link.reply_timeout_s
        republished = 0
        while True:
            message = link.poll(max(0.0, deadline - link.clock()), awaiting=batch)
            if isinstance(message, ServerOutput):
                if output and message.seq == batch.seq:
                    link.stats.replies_received += 1
                    return message.activations
                link.stats.duplicates_dropped += 1  # e.g. a redelivered batch's forward
            elif isinstance(message, GradientReply):
                grad = self._on_reply(message, batch, tally=tally)
                if grad is not None and output:
                    raise RoundAborted(f"seq {batch.seq}: a gradient before its tail gradient")
                if grad is not None:
                    return grad
            elif message is not None:
                self._on_other(message, batch)
            elif link.clock() >= deadline:
                if republished >= link.max_republish:
                    raise RoundAborted(
                        f"round {self._round + 1}: no gradient for seq {batch.seq} after "
                        f"{republished + 1} tries of {link.reply_timeout_s:.1f} s"
                    )
                republished += 1
                link.stats.republished += 1
                link.log.warning(
                    "no gradient for seq %d (round %d step %d) after %.1f s; publishing it again",
                    batch.seq,
                    batch.round + 1,
                    batch.step,
                    link.reply_timeout_s,
                )
                for body, message_id in copies:
                    link.publish(SMASHED_EXCHANGE, self._routing_key, body, message_id=message_id)
                deadline = link.clock() + link.reply_timeout_s

    def _on_reply(
        self, reply: GradientReply, batch: SmashedBatch, *, tally: bool = True
    ) -> torch.Tensor | None:
        """The gradient of an ok answer to `batch`; `tally`: count the worker's loss (a
        U-shaped step's loss is the client's own)."""
        if reply.seq != batch.seq:
            if self._link.took_late(reply):
                if reply.status == "ok":
                    self.tally.add(reply.loss, reply.correct, reply.samples)
            else:
                self._link.log.debug(
                    "dropped GradientReply seq %d (awaiting %d)", reply.seq, batch.seq
                )
            return None
        if reply.status == "stale":
            # Held (e.g. in MiniBatch-SFL's step barrier): its real answer is on the way.
            self._link.stats.stale_replies += 1
            return None
        if reply.status == "ok":
            self._link.stats.replies_received += 1
            if tally:
                self.tally.add(reply.loss, reply.correct, reply.samples)
            assert reply.grad is not None  # the link refused an ok reply without one
            return reply.grad
        where = f"round {self._round + 1} step {batch.step}: shard {self._shard}"
        if reply.status == "gone":
            # Applied, its gradient lost: no wait brings it, and every algorithm that waits
            # needs it, so the round ends here (and says so at once).
            self._link.stats.gone_replies += 1
            raise RoundAborted(
                f"{where} applied seq {batch.seq}, its gradient is gone: "
                f"{reply.reason or 'no reason'}"
            )
        if reply.status == "rejected" and reply.reason.startswith(TOO_STALE):
            raise StaleWeights(f"round {self._round + 1}: {reply.reason}")
        raise RoundAborted(
            f"{where} answered seq {batch.seq} with status {reply.status!r}: "
            f"{reply.reason or 'no reason'}"
        )

    def _on_other(self, message: Message, batch: SmashedBatch) -> None:
        """Replies for the main loop wait; one that ends this round ends it now."""
        self._link.defer(message)
        if isinstance(message, WeightsAssignment) and (
            message.round > self._round or not message.participate
        ):
            raise Superseded(
                f"round {self._round + 1} superseded by an assignment for round {message.round + 1}"
            )
        if isinstance(message, Error) and message.ref_message_id == batch.message_id:
            raise RoundAborted(f"seq {batch.seq} refused: {message.code}: {message.reason}")
