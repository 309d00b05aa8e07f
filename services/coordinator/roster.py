"""The job's client members as the coordinator keeps them: the store's record, and the
coordinator's `MemberIndex` of it, changed together so that each event costs O(1) store work.

The index can lag the store only by expiries (Redis drops a member whose TTL ran out, and any
reader of the members prunes the expired ones). So each member of the index has a deadline
(`Deadlines`: when it expires unless renewed, moved by each renewal), and the sweep asks the
store about the members past their deadline only (`member_ttls`, one step, no read of the
others): those gone are dropped and announced, once; the others are due again when the store
says. A member the coordinator reads one by one (a Join, a Leave, a heartbeat) is corrected
there and then. A read of every member (`sync`) rebuilds the index at the start, before a Join
is refused for a full job (an expired member's partition may count as taken until the sweep
after its deadline), and every `SYNC_SWEEPS`-th sweep, for a record this coordinator did not
write (another coordinator's, an operator's).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from broker.store import MemberStore
from services.common.membership import (
    HOST_HEARTBEAT_MEMBERS,
    MemberInfo,
    client_members,
    member_id,
)
from services.coordinator.index import Deadlines, MemberIndex

# Every this many sweeps, one is a full `sync` (a minute at `clients.heartbeat_s = 2`).
SYNC_SWEEPS = 30
# Deadlines are kept to this step: an expiry is noticed at the first sweep at least this long
# after it fell due.
_DEADLINE_STEP_S = 0.5


class Roster:
    def __init__(
        self,
        store: MemberStore,
        job: str,
        *,
        count: int,
        ttl_s: float,
        expired: Callable[[Sequence[str]], None],
        clock: Callable[[], float],
        expired_members: Callable[[Sequence[MemberInfo]], None] | None = None,
    ) -> None:
        """`expired` is told the clients found gone, `expired_members` (if given) their last
        records, in the same order (the schedule record wants their partition and shard)."""
        self._store = store
        self._job = job
        self._count = count
        self._ttl_s = ttl_s
        self._expired = expired  # told of members found gone, to announce them
        self._expired_members = expired_members
        self._clock = clock
        self.index = MemberIndex(count)
        self.deadlines = Deadlines(_DEADLINE_STEP_S)
        self._synced_at: float | None = None
        self._sweeps = 0

    def sync(self) -> None:
        """Rebuild the index from one read of all members; announce those gone since."""
        live = client_members(self._store, self._job)
        now = self._synced_at = self._clock()
        gone = sorted(self.index.clients() - set(live))
        records = [r for r in map(self.index.discard, gone) if r is not None]
        self.index = MemberIndex(self._count, live.values())
        for client in gone:
            self.deadlines.drop(client)
        for client in live:
            if client not in self.deadlines:
                # Its expiry is the store's (another clock): due at the latest it can be.
                self.deadlines.set(client, now + self._ttl_s)
        if gone:
            self._announce(gone, records)

    def sync_if_older(self, age_s: float) -> bool:
        """`sync` unless the last one is younger than `age_s`; whether it ran."""
        if self._synced_at is not None and self._clock() - self._synced_at < age_s:
            return False
        self.sync()
        return True

    def sweep(self) -> None:
        """Ask the store about the members past their deadline (no read of the others); drop
        and announce those gone. Every `SYNC_SWEEPS`-th sweep is a `sync` instead."""
        self._sweeps += 1
        if self._sweeps % SYNC_SWEEPS == 0:
            self.sync()
            return
        due = self.deadlines.due(self._clock())
        for start in range(0, len(due), HOST_HEARTBEAT_MEMBERS):
            batch = due[start : start + HOST_HEARTBEAT_MEMBERS]
            left = self._store.member_ttls(self._job, [member_id(c) for c in batch])
            now = self._clock()
            for client, ttl_s in zip(batch, left, strict=True):
                if ttl_s is not None:
                    self.deadlines.set(client, now + ttl_s)
            self._forget(c for c, ttl_s in zip(batch, left, strict=True) if ttl_s is None)

    def lookup(self, client: str) -> MemberInfo | None:
        """`client`'s record if it is a live member (one read of one member)."""
        found = self._store.member(self._job, member_id(client))
        info = None if found is None else MemberInfo.from_member(found)
        if info is None:
            self._forget([client])
        else:
            self.index.add(info)
            if client not in self.deadlines:
                self.deadlines.set(client, self._clock() + self._ttl_s)
        return info

    def renew(self, clients: Sequence[str]) -> list[bool]:
        """Renew the live ones of `clients` (one store step); per client, whether it was."""
        live = self._store.renew_members(self._job, [member_id(c) for c in clients], self._ttl_s)
        due = self._clock() + self._ttl_s  # read after the store's: never before its expiry
        for client, renewed in zip(clients, live, strict=True):
            if renewed and client in self.index:
                self.deadlines.set(client, due)
        self._forget(c for c, renewed in zip(clients, live, strict=True) if not renewed)
        return live

    def record(self, info: MemberInfo) -> None:
        """Write `info` as its client's live record, for the membership TTL."""
        self._store.heartbeat(self._job, member_id(info.client), self._ttl_s, info.to_info())
        self.index.add(info)
        self.deadlines.set(info.client, self._clock() + self._ttl_s)

    def remove(self, client: str) -> None:
        self._store.remove_member(self._job, member_id(client))
        self.index.discard(client)
        self.deadlines.drop(client)

    def _forget(self, clients: Iterable[str]) -> None:
        """Drop from the index members the store no longer has: they expired."""
        gone, records = [], []
        for client in clients:
            self.deadlines.drop(client)
            if (record := self.index.discard(client)) is not None:
                gone.append(client)
                records.append(record)
        if gone:
            self._announce(gone, records)

    def _announce(self, gone: list[str], records: list[MemberInfo]) -> None:
        self._expired(gone)
        if self._expired_members is not None:
            self._expired_members(records)
