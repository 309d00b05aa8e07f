"""Asynchronous aggregation as a wrapper around any strategy's `aggregate` (pure functions).

Each buffered update is *rebased*: its change is scaled by the staleness weight and replayed on
what the client would be handed now,

    w' = w_now + s(tau) * (w - w_base)

and the K rebased updates go to the strategy's own `aggregate` with the current version as
`previous` (for the averaging strategies, FedBuff's step with a server learning rate of 1; with
tau = 0 for every update, exactly the synchronous rule). docs/async.md, "The fold: a wrapper
around each strategy's own aggregation", says why and what passes through unchanged. Shard
replicas are rebased the same way with weight 1 (a worker's step is never stale: it trains on
the newest smashed data it gets), from their last folded state: see `rebased_replica`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

import torch

from services.algorithms.base import ClientUpdate, ShardReplica, State, StrategyBase, VersionWeights
from services.algorithms.staleness import StalenessRule


@dataclass(frozen=True)
class StaleUpdate:
    """A buffered update with what it started from and what it would start from now."""

    update: ClientUpdate
    tau: int
    base_client: State  # the client-side weights it was handed at its base version
    base_aux: State
    current_client: State  # what it would be handed at the current version
    current_aux: State


# Normalisation statistics are running estimates, not trained parameters: replaying their
# change on other weights can even make a variance negative. They keep the update's own value
# (the strategy then averages them as in sync mode).
STATISTICS = ("running_mean", "running_var", "num_batches_tracked")


def is_statistic(name: str) -> bool:
    return name.rsplit(".", 1)[-1] in STATISTICS


def rebase_state(
    update: State, base: State, current: State, weight: float
) -> dict[str, torch.Tensor]:
    """`current + weight * (update - base)` per floating tensor of `update`.

    Tensors missing from `base` or `current`, integer ones and normalisation statistics
    (`is_statistic`) keep the update's value. Accumulated in float64, cast back to the
    update's dtype.
    """
    out: dict[str, torch.Tensor] = {}
    for name, tensor in update.items():
        b, c = base.get(name), current.get(name)
        if (
            b is None
            or c is None
            or not tensor.is_floating_point()
            or b.shape != tensor.shape
            or is_statistic(name)
        ):
            out[name] = tensor
            continue
        delta = tensor.detach().to(torch.float64) - b.detach().to(torch.float64)
        out[name] = (c.detach().to(torch.float64) + weight * delta).to(tensor.dtype)
    return out


def rebased_update(stale: StaleUpdate, rule: StalenessRule) -> ClientUpdate:
    """The update as if trained from the current version, its change scaled by s(tau)."""
    if stale.tau == 0:
        return stale.update  # base and current are the same blobs: nothing to replay
    weight = rule.weight(stale.tau)
    u = stale.update
    return replace(
        u,
        client_weights=rebase_state(
            u.client_weights, stale.base_client, stale.current_client, weight
        ),
        aux_weights=rebase_state(u.aux_weights, stale.base_aux, stale.current_aux, weight),
    )


def rebased_replica(
    shard: int,
    weights: State,
    base: State,
    current: State,
    samples: int,
    cut_samples: Mapping[str, int] | None = None,
) -> ShardReplica:
    """A shard's fresh progress (`weights - base`) replayed on the current server weights."""
    return ShardReplica(
        shard=shard,
        samples=samples,
        weights=rebase_state(weights, base, current, 1.0),
        cut_samples=dict(cut_samples or {}),
    )


def fold(
    strategy: StrategyBase,
    current: VersionWeights,
    updates: Sequence[StaleUpdate],
    rule: StalenessRule,
    replicas: Sequence[ShardReplica] = (),
) -> VersionWeights:
    """The next version from the buffered `updates` (and fresh `replicas`), by the strategy's
    own aggregation of their rebased forms."""
    if not updates:
        raise ValueError("nothing buffered to fold")
    for stale in updates:
        if not rule.accepts(stale.tau):
            raise ValueError(
                f"update of {stale.update.client} is {stale.tau} versions stale, "
                f"beyond max_staleness {rule.max_staleness}"
            )
    return strategy.aggregate(current, [rebased_update(s, rule) for s in updates], replicas)
