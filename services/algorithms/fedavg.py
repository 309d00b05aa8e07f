"""FedAvg (McMahan et al.), the no-split baseline: each client trains the whole model and the
aggregator takes `w = sum_k alpha_k w_k`. The whole model travels as the `client` blob."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from broker.store import CLIENT_PART, BlobRef
from models.split import SplitNet
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

CLIENT = BlobRef(CLIENT_PART)


def full_state(model: SplitNet) -> dict[str, torch.Tensor]:
    """The blocks' state (heads excluded: FedAvg has none)."""
    return {k: v.detach().clone() for k, v in model.state_dict().items() if k.startswith("blocks.")}


@dataclass(frozen=True)
class FedAvg:
    name: str = "fedavg"
    splits: bool = False
    waits_for_gradient: bool = False
    server_barrier: bool = False

    def initial_weights(self, model: SplitNet, cut: str) -> VersionWeights:
        return {CLIENT: full_state(model)}

    def client_round(
        self,
        model: SplitNet,
        cut: str,
        batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
        steps: int,
        channel: SmashedChannel,
        hyper: Hyper,
        context: ClientContext,
    ) -> RoundResult:
        model.train()
        params = [p for name, p in model.named_parameters() if name.startswith("blocks.")]
        optimizer = hyper.client_optimizer(params)
        samples = 0
        for x, y in batches:
            loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            samples += int(y.shape[0])
        return RoundResult(full_state(model), metrics={"train_samples": float(samples)})

    def server_step(
        self, server: nn.Module, optimizer: torch.optim.Optimizer, batches: Sequence[CohortBatch]
    ) -> list[tuple[torch.Tensor, float, int]]:
        raise RuntimeError("FedAvg has no server-side model: no smashed data should arrive")

    def aggregate(
        self,
        previous: VersionWeights,
        updates: Sequence[ClientUpdate],
        replicas: Sequence[ShardReplica],
    ) -> VersionWeights:
        if not updates:
            raise ValueError("no client updates to aggregate")
        out = dict(previous)
        out[CLIENT] = weighted_average(
            [u.client_weights for u in updates], [u.samples for u in updates]
        )
        return out
