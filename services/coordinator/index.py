"""The coordinator's index of the live client members: by id, the partitions they hold and the
members per shard, so that a Join, a Leave or a heartbeat costs O(log N), not a read of every
member (issue 13: a job of 100,000 clients heartbeats ~50,000 times a second). The store stays
the record; how the index and the `Deadlines` of its members follow it: roster.py.
"""

from __future__ import annotations

import heapq
import math
from collections import Counter
from collections.abc import Iterable, Mapping

from services.common.membership import MemberInfo


class Partitions:
    """Which of the job's `count` partitions are held, and the lowest free one without a scan
    of all `count`: indices never held sit above `_fresh`, freed ones in a heap. A heap entry
    may be held again since it was pushed (a Join asked for it by index): it is dropped when it
    comes to the top (lazy deletion)."""

    def __init__(self, count: int) -> None:
        self.count = count
        self._holders: Counter[int] = Counter()  # a partition held twice stays held once freed
        self._freed: list[int] = []
        self._fresh = 0  # every index below it has been handed out or skipped

    def __contains__(self, partition: object) -> bool:
        return partition in self._holders

    def take(self, partition: int) -> None:
        self._holders[partition] += 1

    def release(self, partition: int) -> None:
        self._holders[partition] -= 1
        if self._holders[partition] > 0:
            return
        del self._holders[partition]
        if 0 <= partition < self._fresh:
            heapq.heappush(self._freed, partition)

    def lowest_free(self) -> int | None:
        """The lowest free index below `count`; None when all are held."""
        while self._freed and self._freed[0] in self._holders:
            heapq.heappop(self._freed)
        while self._fresh < self.count and self._fresh in self._holders:
            self._fresh += 1
        fresh = self._fresh if self._fresh < self.count else None
        if not self._freed:
            return fresh
        return self._freed[0] if fresh is None else min(self._freed[0], fresh)

    def choose(self, requested: int | None) -> int | None:
        """The requested index when it is valid and free, else the lowest free index; None
        when all `count` partitions are taken (the job is full)."""
        if requested is not None and 0 <= requested < self.count and requested not in self:
            return requested
        return self.lowest_free()


class MemberIndex:
    """Live client members by id, with their partitions (`partitions`), the clients holding
    each partition, and the live members per shard (`loads`)."""

    def __init__(self, count: int, members: Iterable[MemberInfo] = ()) -> None:
        self._members: dict[str, MemberInfo] = {}
        self.partitions = Partitions(count)
        self._by_partition: dict[int, set[str]] = {}
        self._loads: Counter[int] = Counter()
        for member in members:
            self.add(member)

    def __len__(self) -> int:
        return len(self._members)

    def __contains__(self, client: object) -> bool:
        return client in self._members

    def clients(self) -> set[str]:
        return set(self._members)

    def holders(self, partition: int) -> set[str]:
        """The members holding `partition` (more than one only if the store's record says so)."""
        return set(self._by_partition.get(partition, ()))

    @property
    def loads(self) -> Mapping[int, int]:
        """Live members per shard."""
        return self._loads

    def add(self, member: MemberInfo) -> None:
        """Record `member`, replacing what was recorded for its client."""
        self.discard(member.client)
        self._members[member.client] = member
        self.partitions.take(member.partition)
        self._by_partition.setdefault(member.partition, set()).add(member.client)
        self._loads[member.shard] += 1

    def discard(self, client: str) -> MemberInfo | None:
        """Forget `client`; what was recorded for it, if anything."""
        member = self._members.pop(client, None)
        if member is None:
            return None
        self.partitions.release(member.partition)
        holders = self._by_partition[member.partition]
        holders.discard(client)
        if not holders:
            del self._by_partition[member.partition]
        self._loads[member.shard] -= 1
        if not self._loads[member.shard]:
            del self._loads[member.shard]
        return member


class Deadlines:
    """When each member is due to expire, in buckets of `step_s`: setting one costs O(1) (a
    renewal moves its member to a later bucket) and `due` costs the members due plus the
    buckets passed since the last call, never a pass over every member."""

    def __init__(self, step_s: float) -> None:
        if step_s <= 0:
            raise ValueError(f"step_s must be > 0, got {step_s}")
        self._step_s = step_s
        self._bucket: dict[str, int] = {}  # member -> its bucket
        self._members: dict[int, set[str]] = {}  # bucket -> its members
        self._low: int | None = None  # no bucket below it holds a member

    def __len__(self) -> int:
        return len(self._bucket)

    def set(self, member: str, at: float) -> None:
        """`member` is due at `at` (its bucket's end: never before `at`)."""
        bucket = math.ceil(at / self._step_s)
        before = self._bucket.get(member)
        if before == bucket:
            return
        if before is not None:
            self._leave(member, before)
        self._bucket[member] = bucket
        self._members.setdefault(bucket, set()).add(member)
        self._low = bucket if self._low is None else min(self._low, bucket)

    def __contains__(self, member: object) -> bool:
        return member in self._bucket

    def drop(self, member: str) -> None:
        bucket = self._bucket.pop(member, None)
        if bucket is not None:
            self._leave(member, bucket)

    def due(self, now: float) -> list[str]:
        """Take out and return the members due by `now`."""
        last = math.floor(now / self._step_s)
        if self._low is None or self._low > last:
            return []
        # Bucket by bucket since the last call; over the held buckets after a long gap.
        span = range(self._low, last + 1)
        buckets = span if len(span) <= len(self._members) else sorted(self._members)
        out: list[str] = []
        for bucket in buckets:
            if bucket > last:
                break
            for member in self._members.pop(bucket, ()):
                del self._bucket[member]
                out.append(member)
        self._low = last + 1 if self._members else None
        return out

    def _leave(self, member: str, bucket: int) -> None:
        members = self._members[bucket]
        members.discard(member)
        if not members:
            del self._members[bucket]
        if not self._members:
            self._low = None
