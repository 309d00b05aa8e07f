"""MiniBatch-SFL (Huang, Tian, Tang): at step i every cohort client sends z_n; the worker takes
ONE server step on all of them, equation (3), returning each dh/dz_n at the pre-update weights.
Client sides are averaged with p_n = D_n / sum D after each round of E local epochs, which is
SFL's client side and aggregation; only the server step differs. That per-step barrier over
the cohort needs rounds: the algorithm stays synchronous.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import torch
from torch import nn

from services.algorithms.base import CohortBatch, OpenStep, ServerSide, StepResults, algorithm
from services.algorithms.recipe import LossFn, cross_entropy
from services.algorithms.sfl import SFL, weighted_step
from services.algorithms.ushape import forward_open


@dataclass(frozen=True)
class MiniBatchServer(ServerSide):
    """Equation (3): one step per step index over the cohort's batches, weighted by p_n."""

    barrier: bool = True
    u_shaped: bool = True

    def step(
        self,
        server: nn.Module,
        optimizer: torch.optim.Optimizer,
        batches: Sequence[CohortBatch],
        *,
        loss: LossFn = cross_entropy,
    ) -> StepResults:
        return weighted_step(
            server,
            optimizer,
            [b.activations for b in batches],
            [b.labels for b in batches],
            [b.weight for b in batches],
            loss=loss,
        ).rows()

    def forward(
        self, server: nn.Module, zs: Sequence[torch.Tensor], weights: Sequence[float]
    ) -> OpenStep:
        """Equation (3)'s forward: one per client's batch, weighted by p_n."""
        return forward_open(server, zs, weights, concat=False)


@algorithm("minibatch_sfl", sync_only=True, shards="one")
class MiniBatchSFL(SFL):
    name: str = "minibatch_sfl"

    @cached_property
    def server(self) -> ServerSide | None:
        return MiniBatchServer()
