"""SplitFed (Thapa et al.): SFL-V2 (one shared server model, S=1), SFL-V1 (one per client,
S=K) and the sharded middle ground; the shard count is the only difference between them.

Client: forward the body, send z, backprop the returned dL/dz. Worker: one sequential step per
message (or one step over a few folded messages). Aggregation: client sides FedAvg-ed with
alpha_k = |D_k| / sum |D_i|, shard replicas averaged by the samples they trained on.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from broker.store import AUX_PART, CLIENT_PART, SERVER_PART, BlobRef
from models.split import SplitNet
from models.state import client_state, head_state, server_state
from services.algorithms.averaging import weighted_average
from services.algorithms.base import (
    ClientContext,
    ClientUpdate,
    CohortBatch,
    Hyper,
    RoundResult,
    ShardReplica,
    SmashedChannel,
    VersionWeights,
)
from services.algorithms.server_math import sequential_step, weighted_step

CLIENT = BlobRef(CLIENT_PART)
SERVER = BlobRef(SERVER_PART)
AUX = BlobRef(AUX_PART)


def split_initial_weights(model: SplitNet, cut: str) -> VersionWeights:
    return {
        CLIENT: client_state(model, cut),
        SERVER: server_state(model, cut),
        AUX: head_state(model, model.cuts),
    }


def split_client_round(
    model: SplitNet,
    cut: str,
    batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
    steps: int,
    channel: SmashedChannel,
    hyper: Hyper,
    context: ClientContext,
) -> RoundResult:
    """Plain split training of the client side: every step waits for the server's dL/dz."""
    body = model.client_blocks(cut)
    body.train()
    optimizer = hyper.client_optimizer(body.parameters())
    samples = 0
    for step, (x, y) in enumerate(batches):
        z = body(x)
        grad = channel.exchange(z.detach(), y, step, steps)
        optimizer.zero_grad(set_to_none=True)
        z.backward(grad.to(dtype=z.dtype))
        optimizer.step()
        samples += int(y.shape[0])
    return RoundResult(client_state(model, cut), metrics={"train_samples": float(samples)})


def average_round(
    previous: VersionWeights, updates: Sequence[ClientUpdate], replicas: Sequence[ShardReplica]
) -> VersionWeights:
    """FedAvg of the client sides; replicas averaged by samples trained (previous if none)."""
    if not updates:
        raise ValueError("no client updates to aggregate")
    out = dict(previous)
    out[CLIENT] = weighted_average(
        [u.client_weights for u in updates], [u.samples for u in updates]
    )
    trained = [r for r in replicas if r.samples > 0]
    if trained:
        out[SERVER] = weighted_average([r.weights for r in trained], [r.samples for r in trained])
    return out


@dataclass(frozen=True)
class SFL:
    """SFL-V1 / SFL-V2 / sharded SFL; `fold` > 1 lets a worker fold queued messages."""

    name: str = "sfl"
    splits: bool = True
    waits_for_gradient: bool = True
    server_barrier: bool = False

    def initial_weights(self, model: SplitNet, cut: str) -> VersionWeights:
        return split_initial_weights(model, cut)

    client_round = staticmethod(split_client_round)

    def server_step(
        self, server: nn.Module, optimizer: torch.optim.Optimizer, batches: Sequence[CohortBatch]
    ) -> list[tuple[torch.Tensor, float, int]]:
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

    aggregate = staticmethod(average_round)
