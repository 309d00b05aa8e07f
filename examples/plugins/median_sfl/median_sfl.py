"""Median SFL: SplitFed whose client sides are merged by their coordinate-wise median, which a
few outlying clients cannot drag far; the server side is averaged as in SFL."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Self

import torch
from pydantic import Field

from services.algorithms.base import (
    CLIENT,
    ClientUpdate,
    Params,
    ShardReplica,
    State,
    VersionWeights,
    algorithm,
    average_replicas,
)
from services.algorithms.sfl import SFL


class MedianSection(Params):
    # With fewer updates in a round the median is no better than the mean: FedAvg them.
    min_updates: int = Field(default=3, ge=1)


def coordinate_median(states: Sequence[State]) -> dict[str, torch.Tensor]:
    """Per tensor and element, the median over `states` (the lower middle of an even count)."""
    return {n: torch.stack([s[n] for s in states]).median(dim=0).values for n in states[0]}


@algorithm("median_sfl", params=MedianSection, shards="one")
class MedianSFL(SFL):
    name: str = "median_sfl"
    min_updates: int = 3

    @classmethod
    def create(cls, name: str, params: Params | None) -> Self:
        assert isinstance(params, MedianSection)
        return cls(name=name, min_updates=params.min_updates)

    def aggregate(
        self,
        previous: VersionWeights,
        updates: Sequence[ClientUpdate],
        replicas: Sequence[ShardReplica],
    ) -> VersionWeights:
        if len(updates) < self.min_updates:
            return super().aggregate(previous, updates, replicas)
        out = dict(previous)
        out[CLIENT] = coordinate_median([u.client_weights for u in updates])
        return average_replicas(out, replicas)
