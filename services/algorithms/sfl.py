"""SplitFed (Thapa et al.): SFL-V2 (one shared server model, S=1), SFL-V1 (one per client,
S=K) and the sharded middle ground; the shard count is the only difference between them.

Client: forward the body, send z, backprop the returned dL/dz. Worker: one sequential step per
message (or one step over a few folded messages). Aggregation: client sides FedAvg-ed with
alpha_k = |D_k| / sum |D_i|, shard replicas averaged by the samples they trained on (the
base's `average_round`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from models.state import client_state
from services.algorithms.base import (
    CohortBatch,
    LocalRound,
    RoundResult,
    StepResults,
    StrategyBase,
    algorithm,
)
from services.algorithms.server_math import sequential_step, weighted_step


@algorithm("sfl_v1", shards="per_client")
@algorithm("sfl_v2", shards="one")
@algorithm("sfl")
@dataclass(frozen=True, kw_only=True)
class SFL(StrategyBase):
    """SFL-V1 / SFL-V2 / sharded SFL; a worker may fold queued messages into one step."""

    name: str = "sfl"

    def client_round(self, r: LocalRound) -> RoundResult:
        """Plain split training of the client side: every step waits for the server's dL/dz."""
        body = r.model.client_blocks(r.cut)
        body.train()
        optimizer = r.hyper.client_optimizer(body.parameters())
        samples = 0
        for step, (x, y) in enumerate(r.batches):
            z = body(x)
            grad = r.channel.exchange(z.detach(), y, step, r.steps)
            optimizer.zero_grad(set_to_none=True)
            z.backward(grad.to(dtype=z.dtype))
            optimizer.step()
            samples += int(y.shape[0])
        return RoundResult(client_state(r.model, r.cut), metrics={"train_samples": float(samples)})

    def server_step(
        self, server: nn.Module, optimizer: torch.optim.Optimizer, batches: Sequence[CohortBatch]
    ) -> StepResults:
        if len(batches) == 1:
            b = batches[0]
            r = sequential_step(server, optimizer, b.activations, b.labels)
        else:
            # Folded messages: one forward/backward over their concatenation, each weighted by
            # its rows, so the step is the one a single batch of all those rows would take.
            r = weighted_step(
                server,
                optimizer,
                [b.activations for b in batches],
                [b.labels for b in batches],
                [float(b.labels.shape[0]) for b in batches],
                concat=True,
            )
        return list(zip(r.grads, r.losses, r.correct, strict=True))
