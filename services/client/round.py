"""One local round: load the assigned weights, train with the strategy, build the update; and
the round's `SmashedChannel` (`BrokerChannel`): SmashedBatch out to the shard, GradientReply
back.

Replies are matched by `seq`. A reply for an earlier seq is a duplicate (a worker answering a
redelivered or republished copy of a batch the client already got an answer for) and is
dropped; one for a seq never sent (at or past the next seq) is dead-lettered. A batch with no
answer after `reply_timeout_s` is published again with the same seq; a worker that had applied
it answers the copy with the reply it sent (a lost reply costs one timeout), or, where it no
longer has that gradient (another worker applied the batch before a failover), with status
"gone": the round cannot go on without it, and is dropped at once. "stale" (held, the answer is
coming) keeps the client waiting. After `max_republish` copies without an answer the round is
given up.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, replace

import torch
from torch import nn
from torch.nn import functional as F

from broker.codec import encode
from broker.errors import EncodeError, MessageTooLargeError
from broker.messages import (
    ConfigValue,
    Error,
    GradientReply,
    Message,
    SmashedBatch,
    WeightsAssignment,
    WeightsUpdate,
    new_message_id,
)
from broker.topology import SMASHED_EXCHANGE, shard_routing_key
from models.split import SplitNet
from models.state import load_partial
from services.algorithms.base import ClientContext, Strategy
from services.algorithms.registry import build_strategy
from services.algorithms.staleness import TOO_STALE
from services.client.data import JobData, client_batches, round_batches
from services.client.errors import ClientError, RoundAborted, StaleWeights, Superseded
from services.client.link import ClientLink
from services.client.plan import RoundPlan, config_int
from services.data.batches import Batch

EVAL_CHUNK = 512


@dataclass(frozen=True)
class Membership:
    """What the Welcome settled: where this client trains and with what."""

    shard: int
    cut: str
    partition: int
    plan: RoundPlan
    strategy: Strategy

    def updated(self, config: Mapping[str, ConfigValue]) -> Membership:
        """This membership as an assignment's `config` changes it (shard, plan, algorithm)."""
        plan = self.plan.updated(config)
        shard = config_int(config, "shard")
        same = (plan.algorithm, plan.params) == (self.plan.algorithm, self.plan.params)
        return replace(
            self,
            shard=self.shard if shard is None else shard,
            plan=plan,
            strategy=self.strategy if same else build_strategy(plan.algorithm, plan.params),
        )


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

    def __init__(self, link: ClientLink, member: Membership, assignment: WeightsAssignment) -> None:
        self._link = link
        self._round = assignment.round
        self._version = assignment.version
        self._shard = member.shard
        self._cut = member.cut  # where the client's activations come from (its Welcome's cut)
        self._wire_dtype = member.plan.wire_dtype
        self._routing_key = shard_routing_key(link.job, member.shard)
        self.tally = Tally()

    def exchange(self, z: torch.Tensor, y: torch.Tensor, step: int, steps: int) -> torch.Tensor:
        batch, body = self._publish(z, y, step, steps)
        return self._await(batch, body)

    def send(self, z: torch.Tensor, y: torch.Tensor, step: int, steps: int) -> None:
        batch, _ = self._publish(z, y, step, steps)
        self._link.unawaited.add(batch.seq)

    def _publish(
        self, z: torch.Tensor, y: torch.Tensor, step: int, steps: int
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
            labels=y.detach().to(device="cpu", dtype=torch.int64),
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

    def _await(self, batch: SmashedBatch, body: bytes) -> torch.Tensor:
        link = self._link
        deadline = link.clock() + link.reply_timeout_s
        republished = 0
        while True:
            message = link.poll(max(0.0, deadline - link.clock()), awaiting=batch)
            if isinstance(message, GradientReply):
                grad = self._on_reply(message, batch)
                if grad is not None:
                    return grad
            elif message is not None:
                self._on_other(message, batch)
            elif link.clock() >= deadline:
                if republished >= link.max_republish:
                    raise RoundAborted(
                        f"round {self._round}: no gradient for seq {batch.seq} after "
                        f"{republished + 1} tries of {link.reply_timeout_s:.1f} s"
                    )
                republished += 1
                link.stats.republished += 1
                link.log.warning(
                    "no gradient for seq %d (round %d step %d) after %.1f s; publishing it again",
                    batch.seq,
                    batch.round,
                    batch.step,
                    link.reply_timeout_s,
                )
                link.publish(SMASHED_EXCHANGE, self._routing_key, body, message_id=batch.message_id)
                deadline = link.clock() + link.reply_timeout_s

    def _on_reply(self, reply: GradientReply, batch: SmashedBatch) -> torch.Tensor | None:
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
            # The worker holds this seq (e.g. in MiniBatch-SFL's step barrier) and saw our
            # republished copy: its real answer is on the way.
            self._link.stats.stale_replies += 1
            return None
        where = f"round {self._round} step {batch.step}: shard {self._shard}"
        if reply.status == "gone":
            # Applied, but no worker has its gradient any more: no wait brings it. The batch
            # counts on the server side; the client side cannot take this step, and every
            # algorithm that waits needs it, so the round ends here (and says so at once).
            self._link.stats.gone_replies += 1
            raise RoundAborted(
                f"{where} applied seq {batch.seq}, its gradient is gone: "
                f"{reply.reason or 'no reason'}"
            )
        if reply.status == "rejected" and reply.reason.startswith(TOO_STALE):
            raise StaleWeights(f"round {self._round}: {reply.reason}")
        if reply.status != "ok":
            raise RoundAborted(
                f"{where} answered seq {batch.seq} with status {reply.status!r}: "
                f"{reply.reason or 'no reason'}"
            )
        self._link.stats.replies_received += 1
        self.tally.add(reply.loss, reply.correct, reply.samples)
        assert reply.grad is not None  # the link refused an ok reply without one
        return reply.grad

    def _on_other(self, message: Message, batch: SmashedBatch) -> None:
        """Replies for the main loop wait; one that ends this round ends it now."""
        self._link.defer(message)
        if isinstance(message, WeightsAssignment) and (
            message.round > self._round or not message.participate
        ):
            raise Superseded(
                f"round {self._round} superseded by an assignment for round {message.round}"
            )
        if isinstance(message, Error) and message.ref_message_id == batch.message_id:
            raise RoundAborted(f"seq {batch.seq} refused: {message.code}: {message.reason}")


@dataclass
class RoundRunner:
    """Runs the rounds of one client; holds what lives across rounds."""

    link: ClientLink
    model: SplitNet
    data: JobData
    seed: int
    # The algorithm's per-client tensors across rounds (`ClientContext.memory`); cleared when
    # the job switches algorithm.
    memory: dict[str, torch.Tensor] = field(default_factory=dict)
    _memory_of: str = ""

    def run(self, member: Membership, assignment: WeightsAssignment) -> WeightsUpdate:
        """Train one round from `assignment`; raises `RoundAborted` when the round is lost."""
        link, stats = self.link, self.link.stats
        started, io_before = link.clock(), link.io_s
        up_before, down_before = stats.bytes_up, stats.bytes_down
        plan = member.plan
        load_partial(self.model, assignment.client_weights)
        load_partial(self.model, assignment.aux_weights)
        index = member.partition
        batches, steps = round_batches(
            client_batches(self.data, index, batch_size=plan.batch_size, seed=self.seed),
            local_epochs=plan.local_epochs,
            max_steps=plan.max_steps,
            round_index=assignment.round,
        )
        channel = BrokerChannel(link, member, assignment)
        local = Tally()
        hook = None
        if not member.strategy.splits:
            # The whole model runs here: measure its training loss on the batches it sees.
            batches, hook = self._tallied(batches, local)
        if self._memory_of != plan.algorithm:
            self.memory.clear()
            self._memory_of = plan.algorithm
        context = ClientContext(
            client=link.client,
            round=assignment.round,
            memory=self.memory,
            local_accuracy=lambda module: self._local_accuracy(index, module),
        )
        try:
            result = member.strategy.client_round(
                self.model,
                member.cut,
                self._ticking(batches),
                steps,
                channel,
                plan.hyper(),
                context,
            )
        finally:
            if hook is not None:
                hook.remove()
        metrics: dict[str, float] = {**channel.tally.metrics(), **local.metrics()}
        if not member.strategy.splits:
            metrics["personal_accuracy"] = self._local_accuracy(index, self.model)
        metrics.update(
            bytes_up=float(stats.bytes_up - up_before),
            bytes_down=float(stats.bytes_down - down_before),
            compute_s=max(0.0, (link.clock() - started) - (link.io_s - io_before)),
        )
        metrics.update(result.metrics)
        return WeightsUpdate(
            job=link.job,
            client=link.client,
            message_id=new_message_id(),
            version=assignment.version,
            round=assignment.round,
            samples=len(self.data.indices(index)),
            client_weights=result.client_weights,
            aux_weights=result.aux_weights,
            masks=result.masks,
            metrics=metrics,
        )

    def _ticking(self, batches: Iterator[Batch]) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Keeps the broker connection serviced between local steps, for algorithms that never
        wait on the broker (membership heartbeats have a thread of their own)."""
        for x, y in batches:
            self.link.keep_alive()
            yield x, y

    def _tallied(
        self, batches: Iterator[Batch], tally: Tally
    ) -> tuple[Iterator[Batch], torch.utils.hooks.RemovableHandle]:
        labels: list[torch.Tensor] = []

        def on_forward(_module: nn.Module, _inputs: object, logits: torch.Tensor) -> None:
            if labels and logits.requires_grad:  # a training forward of the current batch
                y = labels.pop()
                with torch.no_grad():
                    loss = float(F.cross_entropy(logits, y))
                    correct = int((logits.argmax(dim=1) == y).sum())
                tally.add(loss, correct, int(y.shape[0]))

        def remember() -> Iterator[Batch]:
            for batch in batches:
                labels[:] = [batch.y]
                yield batch

        return remember(), self.model.register_forward_hook(on_forward)

    def _local_accuracy(self, index: int, model: nn.Module) -> float:
        """`model` (inputs -> logits) on the client's local test set."""
        test = self.data.dataset.test
        picked = torch.from_numpy(self.data.local_test(index))
        if not len(picked):
            return 0.0
        was_training = model.training
        model.eval()
        correct = 0
        with torch.no_grad():
            for chunk in picked.split(EVAL_CHUNK):
                logits = model(test.x.index_select(0, chunk))
                correct += int((logits.argmax(dim=1) == test.y.index_select(0, chunk)).sum())
        model.train(was_training)
        return correct / len(picked)
