"""Standalone, the no-collaboration baseline of the Sub-FedAvg paper: each client trains only
its own model. Local training is FedAvg's; nothing is averaged. Each client's model is kept as
its personal blob `client/<id>`, which the service hands back to it alone, so a client resumes
from its own weights whenever it is sampled again (until then: the seeded initial model,
`client/global`, which stays as it was)."""

from __future__ import annotations

from collections.abc import Sequence

from broker.store import CLIENT_PART, BlobRef
from services.algorithms.base import ClientUpdate, ShardReplica, VersionWeights, algorithm
from services.algorithms.fedavg import FedAvg


@algorithm("standalone")
class Standalone(FedAvg):
    name: str = "standalone"

    def aggregate(
        self,
        previous: VersionWeights,
        updates: Sequence[ClientUpdate],
        replicas: Sequence[ShardReplica],
    ) -> VersionWeights:
        if not updates:
            raise ValueError("no client updates to keep")
        out = dict(previous)
        for u in updates:
            out[BlobRef(CLIENT_PART, u.client)] = {
                n: t.detach().clone() for n, t in u.client_weights.items()
            }
        return out
