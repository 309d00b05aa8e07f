"""Turning a closed round into version v+1: the strategy's aggregation and the compare-and-set
publication (architecture step 6)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from broker.store import CLIENT_PART, SERVER_PART, BlobRef, WeightStore
from services.aggregator.gate import OpenRound
from services.algorithms.base import ClientUpdate, ShardReplica, Strategy, VersionWeights


@dataclass(frozen=True)
class Published:
    version: int
    blobs: VersionWeights
    updates: list[ClientUpdate]


def read_version(store: WeightStore, job: str, version: int) -> VersionWeights:
    """Every blob of `version`."""
    return {ref: store.read_blob(job, version, ref) for ref in store.manifest(job, version).entries}


def aggregate_and_publish(
    store: WeightStore,
    job: str,
    strategy: Strategy,
    state: OpenRound,
    replicas: Sequence[ShardReplica],
) -> Published:
    """Aggregate the round into the next version and commit it; raises `VersionConflictError`
    when another aggregator committed that version first."""
    updates = [state.updates[c] for c in sorted(state.updates)]
    blobs = strategy.aggregate(read_version(store, job, state.version), updates, replicas)
    samples = {BlobRef(CLIENT_PART): sum(u.samples for u in updates)}
    if replicas:
        samples[BlobRef(SERVER_PART)] = sum(r.samples for r in replicas)
    version = store.publish_version(
        job,
        state.version,
        blobs,
        samples={ref: n for ref, n in samples.items() if ref in blobs},
        meta={"round": str(state.round), "participants": ",".join(u.client for u in updates)},
    )
    return Published(version, blobs, updates)
