"""One local round: load the assigned weights, train with the strategy, build the update."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.nn import functional as F

from broker.messages import WeightsAssignment, WeightsUpdate, new_message_id
from models.split import SplitNet
from models.state import load_partial
from services.algorithms.base import ClientContext, Strategy
from services.client.channel import BrokerChannel, RoundContext, SeqBook, Tally
from services.client.data import JobData, client_batches, round_batches
from services.client.link import ClientLink
from services.client.plan import RoundPlan
from services.client.stats import ClientStats
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


def weights_problem(model: nn.Module, weights: Mapping[str, torch.Tensor]) -> str | None:
    """Why `weights` cannot be loaded into `model` (unknown name, wrong shape), or None."""
    own = model.state_dict()
    for name, tensor in weights.items():
        if name not in own:
            return f"unknown tensor {name!r} for this model"
        if tensor.shape != own[name].shape:
            return f"{name}: shape {list(tensor.shape)}, the model has {list(own[name].shape)}"
    return None


@dataclass
class RoundRunner:
    """Runs the rounds of one client; holds what lives across rounds."""

    job: str
    client: str
    seed: int
    model: SplitNet
    data: JobData
    link: ClientLink
    seqs: SeqBook
    stats: ClientStats
    reply_timeout_s: float
    max_republish: int
    clock: Callable[[], float]
    logger: logging.Logger
    # The algorithm's per-client tensors across rounds (`ClientContext.memory`); cleared when
    # the job switches algorithm.
    memory: dict[str, torch.Tensor] = field(default_factory=dict)
    _memory_of: str = ""

    def __post_init__(self) -> None:
        # Before any state: a GradientReply for a seq this client never sent is dead-lettered
        # wherever it is received (in a round or between rounds).
        self.link.validate_with(self.seqs.reply_problem)

    def run(self, member: Membership, assignment: WeightsAssignment) -> WeightsUpdate:
        """Train one round from `assignment`; raises `RoundAborted` when the round is lost."""
        started, io_before = self.clock(), self.link.io_s
        up_before, down_before = self.stats.bytes_up, self.stats.bytes_down
        plan = member.plan
        load_partial(self.model, assignment.client_weights)
        load_partial(self.model, assignment.aux_weights)
        index = member.partition
        indices = self.data.indices(index)
        batches, steps = round_batches(
            client_batches(self.data, index, batch_size=plan.batch_size, seed=self.seed),
            local_epochs=plan.local_epochs,
            max_steps=plan.max_steps,
            round_index=assignment.round,
        )
        channel = BrokerChannel(
            self.link,
            RoundContext(
                self.job,
                self.client,
                assignment.round,
                assignment.version,
                member.shard,
                plan.wire_dtype,
                member.cut,
            ),
            self.seqs,
            reply_timeout_s=self.reply_timeout_s,
            max_republish=self.max_republish,
            stats=self.stats,
            clock=self.clock,
            logger=self.logger,
        )
        local = Tally()
        hook = None
        if not member.strategy.splits:
            # The whole model runs here: measure its training loss on the batches it sees.
            batches, hook = self._tallied(batches, local)
        if self._memory_of != plan.algorithm:
            self.memory.clear()
            self._memory_of = plan.algorithm
        context = ClientContext(
            client=self.client,
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
            bytes_up=float(self.stats.bytes_up - up_before),
            bytes_down=float(self.stats.bytes_down - down_before),
            compute_s=max(0.0, (self.clock() - started) - (self.link.io_s - io_before)),
        )
        metrics.update(result.metrics)
        return WeightsUpdate(
            job=self.job,
            client=self.client,
            message_id=new_message_id(),
            version=assignment.version,
            round=assignment.round,
            samples=len(indices),
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
