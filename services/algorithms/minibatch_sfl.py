"""MiniBatch-SFL (Huang, Tian, Tang): at step i every cohort client sends z_n; the worker takes
ONE server step on all of them, equation (3), returning each dh/dz_n at the pre-update weights.
Client sides are averaged with p_n = D_n / sum D after each round of E local epochs.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from models.split import SplitNet
from services.algorithms.base import (
    ClientUpdate,
    CohortBatch,
    Hyper,
    RoundResult,
    ShardReplica,
    SmashedChannel,
    VersionWeights,
)
from services.algorithms.server_math import weighted_step
from services.algorithms.sfl import average_round, split_client_round, split_initial_weights


@dataclass(frozen=True)
class MiniBatchSFL:
    name: str = "minibatch_sfl"
    splits: bool = True
    waits_for_gradient: bool = True
    server_barrier: bool = True

    def initial_weights(self, model: SplitNet, cut: str) -> VersionWeights:
        return split_initial_weights(model, cut)

    def client_round(
        self,
        model: SplitNet,
        cut: str,
        batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
        steps: int,
        channel: SmashedChannel,
        hyper: Hyper,
    ) -> RoundResult:
        return split_client_round(model, cut, batches, steps, channel, hyper)

    def server_step(
        self, server: nn.Module, optimizer: torch.optim.Optimizer, batches: Sequence[CohortBatch]
    ) -> list[tuple[torch.Tensor, float, int]]:
        r = weighted_step(
            server,
            optimizer,
            [b.activations for b in batches],
            [b.labels for b in batches],
            [b.weight for b in batches],
        )
        return list(zip(r.grads, r.losses, r.correct, strict=True))

    def aggregate(
        self,
        previous: VersionWeights,
        updates: Sequence[ClientUpdate],
        replicas: Sequence[ShardReplica],
    ) -> VersionWeights:
        return average_round(previous, updates, replicas)
