"""Where a joining client goes: its data partition index and its shard (pure functions)."""

from __future__ import annotations

from collections.abc import Collection, Mapping


def choose_partition(requested: int | None, taken: Collection[int], count: int) -> int | None:
    """The requested index when it is valid and free, else the lowest free index below
    `count`; None when all `count` partitions are taken (the job is full)."""
    if requested is not None and 0 <= requested < count and requested not in taken:
        return requested
    return next((i for i in range(count) if i not in taken), None)


def choose_shard(shards: int, clients: int, partition: int, loads: Mapping[int, int]) -> int:
    """The shard of a new member.

    With one shard per client (SFL-V1) shard k belongs to partition k, so a client's server
    model follows its data across re-joins. Otherwise the least-loaded shard (by live members,
    ties to the lowest index) keeps every worker's queue equally busy.
    """
    if shards == clients:
        return partition % shards
    return min(range(shards), key=lambda s: (loads.get(s, 0), s))
