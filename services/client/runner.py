"""One client's rounds (`RoundRunner`): load an assignment's weights, run the algorithm's
local round over a `BrokerChannel`, and build the `WeightsUpdate` with the round's metrics.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import torch
from torch import nn

from broker.messages import WeightsAssignment, WeightsUpdate, new_message_id
from models.split import SplitNet, evaluating
from models.state import load_partial
from services.algorithms.base import ClientContext, LocalRound
from services.algorithms.recipe import LossFn
from services.client.channel import BrokerChannel, Tally
from services.client.data import JobData, client_batches, round_batches
from services.client.lending import Seat
from services.client.link import ClientLink
from services.client.membership import Membership
from services.data.batches import Batch

EVAL_CHUNK = 512


@dataclass
class RoundRunner:
    """Runs the rounds of one client; holds what lives across rounds."""

    link: ClientLink
    seat: Seat
    data: JobData
    seed: int
    # `evaluation.enabled`: a whole-model client reports its local accuracy after the round.
    evaluate: bool = True

    def run(
        self, model: SplitNet, member: Membership, assignment: WeightsAssignment
    ) -> WeightsUpdate:
        """Train one round from `assignment` on `model` (the update's tensors may be views of
        its weights: send it before the model goes back); raises `RoundAborted` when the
        round is lost."""
        link, stats = self.link, self.link.stats
        started, io_before = link.clock(), link.io_s
        up_before, down_before = stats.bytes_up, stats.bytes_down
        plan = member.plan
        load_partial(model, assignment.client_weights)
        load_partial(model, assignment.aux_weights)
        index = member.partition
        batches, steps = round_batches(
            client_batches(self.data, index, batch_size=plan.batch_size, seed=self.seed),
            local_epochs=plan.hyper.local_epochs,
            max_steps=plan.hyper.max_steps,
            round_index=assignment.round,
        )
        channel = BrokerChannel(
            link, assignment, shard=member.shard, cut=member.cut, wire_dtype=plan.wire_dtype
        )
        local = Tally()
        hook = None
        server = member.strategy.server
        if server is None:
            # The whole model runs here: measure its training loss on the batches it sees.
            batches, hook = self._tallied(model, batches, local, plan.hyper.loss)
        if server is None or not server.waits_for_gradient:
            # Steps that never wait on the broker: keep its connection serviced between them
            # (a split step that waits polls the broker itself).
            batches = self._ticking(batches)
        # The algorithm's per-client tensors (`ClientContext.memory`) are cleared when the job
        # switches algorithm.
        algorithm, memory = self.seat.memory.take()
        if algorithm != plan.algorithm:
            memory = {}
        context = ClientContext(
            client=link.client,
            round=assignment.round,
            memory=memory,
            local_accuracy=lambda module: self._local_accuracy(index, module),
        )
        # A whole-model round waits on nothing: it computes within the host's gate.
        gate: AbstractContextManager[None] = (
            nullcontext() if server is not None else self.seat.compute.held()
        )
        try:
            with gate:
                result = member.strategy.client_round(
                    LocalRound(
                        model,
                        member.cut,
                        batches,
                        steps,
                        channel,
                        plan.hyper.at_round(assignment.round, steps),
                        context,
                    )
                )
        finally:
            if hook is not None:
                hook.remove()
            # What the algorithm remembered so far (a lost round may have changed it too, as
            # it would on a device).
            self.seat.memory.put(plan.algorithm, memory)
        metrics: dict[str, float] = {**channel.tally.metrics(), **local.metrics()}
        # An algorithm that measured its own model already (FedDeper's v_k, Sub-FedAvg's
        # pruned model) reports it in `result.metrics`, which wins below.
        measured = "personal_accuracy" in result.metrics
        if server is None and self.evaluate and not measured:
            metrics["personal_accuracy"] = self._local_accuracy(index, model)
        metrics.update(
            bytes_up=float(stats.bytes_up - up_before),
            bytes_down=float(stats.bytes_down - down_before),
            # The round's wall time, waits for gradients included, and the part of it spent
            # computing: a split client's own rate is not the rate the cohort trains at.
            round_wall_s=max(0.0, link.clock() - started),
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

    def _ticking(self, batches: Iterator[Batch]) -> Iterator[Batch]:
        """Keeps the broker connection serviced between local steps, for algorithms that never
        wait on the broker (membership heartbeats have a thread of their own)."""
        for batch in batches:
            self.link.keep_alive()
            yield batch

    def _tallied(
        self, model: SplitNet, batches: Iterator[Batch], tally: Tally, loss_fn: LossFn
    ) -> tuple[Iterator[Batch], torch.utils.hooks.RemovableHandle]:
        labels: list[torch.Tensor] = []

        def on_forward(_module: nn.Module, _inputs: object, logits: torch.Tensor) -> None:
            if labels and logits.requires_grad:  # a training forward of the current batch
                y = labels.pop()
                with torch.no_grad():
                    loss = float(loss_fn(logits, y))
                    correct = int((logits.argmax(dim=1) == y).sum())
                tally.add(loss, correct, int(y.shape[0]))

        def remember() -> Iterator[Batch]:
            for batch in batches:
                labels[:] = [batch.y]
                yield batch

        return remember(), model.register_forward_hook(on_forward)

    def _local_accuracy(self, index: int, model: nn.Module) -> float:
        """`model` (inputs -> logits) on the client's local test set."""
        test = self.data.dataset.test
        picked = torch.from_numpy(self.data.local_test(index))
        if not len(picked):
            return 0.0
        correct = 0
        with self.seat.compute.held(), evaluating([model]):
            for chunk in picked.split(EVAL_CHUNK):
                logits = model(test.x.index_select(0, chunk))
                correct += int((logits.argmax(dim=1) == test.y.index_select(0, chunk)).sum())
        return correct / len(picked)
