"""Shard leases (design §4 "Balance"): who consumes which shard queue.

Single active consumer guarantees one consumer per shard but not balance: the first worker to
subscribe becomes active everywhere. So each worker registers its liveness (`worker:<id>`
members), counts the live workers W and holds at most ceil(S/W) TTL'd leases `shard:<s>`,
renewing them every tick. It claims free shards starting at an offset derived from its id, so
workers starting together do not all race for shard 0, and hands extras back when W grows
(the caller checkpoints and unsubscribes before `release`).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Collection, Mapping
from contextlib import suppress
from dataclasses import dataclass, field

from broker.keys import SHARD_LEASE_PREFIX, WORKER_MEMBER_PREFIX
from broker.store import Member, MemberKind, MemberStore


def lease_name(shard: int) -> str:
    return f"{SHARD_LEASE_PREFIX}{shard}"


def member_id(worker_id: str) -> str:
    return f"{WORKER_MEMBER_PREFIX}{worker_id}"


def home_shard(worker_id: str, shards: int) -> int:
    """A stable per-worker starting point (not `hash()`, which differs between processes)."""
    digest = hashlib.sha256(worker_id.encode()).digest()
    return int.from_bytes(digest[:8], "big") % shards


@dataclass(frozen=True)
class WorkerBeat:
    """What a worker's heartbeat (`worker:<id>`, written by `LeaseKeeper.plan`) says: the shards
    it holds, and what the worker's `info` adds (its busy fraction, samples, metrics URL)."""

    worker: str
    shards: tuple[int, ...] = ()
    busy: float | None = None  # in [0, 1]
    samples: int | None = None
    metrics: str = ""  # its /metrics URL, "" if it serves none


def worker_beat(member: Member) -> WorkerBeat | None:
    """None for a member that is not a worker; fields that do not parse read as absent (the
    dashboard and the autoscaler must not fail on one worker's odd heartbeat)."""
    if not member.member_id.startswith(WORKER_MEMBER_PREFIX):
        return None
    info = member.info
    shards: tuple[int, ...] = ()
    busy: float | None = None
    samples: int | None = None
    with suppress(ValueError):
        shards = tuple(int(s) for s in info.get("shards", "").split(",") if s)
    with suppress(KeyError, ValueError):
        busy = min(1.0, max(0.0, float(info["busy"])))
    with suppress(KeyError, ValueError):
        samples = int(info["samples"])
    worker = member.member_id[len(WORKER_MEMBER_PREFIX) :]
    return WorkerBeat(worker, shards, busy, samples, info.get("metrics", ""))


@dataclass(frozen=True)
class LeasePlan:
    target: int  # ceil(S / W)
    lost: list[int] = field(default_factory=list)  # held, but someone else has the lease now
    release: list[int] = field(default_factory=list)  # held beyond the target: hand over
    acquired: list[int] = field(default_factory=list)  # newly leased
    workers: int = 0  # live workers W, this one included


class LeaseKeeper:
    def __init__(self, store: MemberStore, job: str, worker_id: str, shards: int, ttl_s: float):
        if shards < 1:
            raise ValueError(f"a job needs at least one shard, got {shards}")
        self._store = store
        self._job = job
        self._worker_id = worker_id
        self._member = member_id(worker_id)
        self._shards = shards
        self._ttl_s = ttl_s
        self._home = home_shard(worker_id, shards)

    def plan(self, held: Collection[int], info: Mapping[str, str] | None = None) -> LeasePlan:
        """Heartbeat, renew `held`, and decide what to hand back or take (taken leases are
        already ours; `release` ones are still ours until `release()`). `info` goes into the
        heartbeat beside `shards` (e.g. the busy fraction the autoscaler reads)."""
        self._store.heartbeat(
            self._job,
            self._member,
            self._ttl_s,
            info={**(info or {}), "shards": ",".join(str(s) for s in sorted(held))},
        )
        live = set(self._store.live_members(self._job, MemberKind.WORKER))  # no client is read
        workers = len(live | {self._member})  # we are alive, whatever the store's clock thinks
        target = math.ceil(self._shards / workers)
        kept: list[int] = []
        lost: list[int] = []
        for shard in sorted(held, key=self._distance):
            (kept if self.renew(shard) else lost).append(shard)
        # Keep the shards nearest our home, hand back the farthest: assignments stay stable.
        kept, release = kept[:target], kept[target:]
        acquired: list[int] = []
        for shard in sorted(range(self._shards), key=self._distance):
            if len(kept) + len(acquired) >= target:
                break
            if shard not in held and self.renew(shard):
                acquired.append(shard)
        return LeasePlan(target, lost, release, acquired, workers)

    def release(self, shard: int) -> None:
        self._store.release_lease(self._job, lease_name(shard), self._worker_id)

    def renew(self, shard: int) -> bool:
        """Take or renew one lease (also before a checkpoint: only the holder may write it)."""
        return self._store.acquire_lease(self._job, lease_name(shard), self._worker_id, self._ttl_s)

    def leave(self) -> None:
        self._store.remove_member(self._job, self._member)

    def _distance(self, shard: int) -> int:
        return (shard - self._home) % self._shards
