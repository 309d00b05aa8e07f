"""The job's client members as the coordinator keeps them: the store's record, and the
coordinator's `MemberIndex` of it, changed together so that each event costs O(1) store work.

The index can lag the store only by expiries (Redis drops a member whose TTL ran out by
itself): `sync` reads every member once per sweep and announces those gone; a member the
coordinator reads one by one (a Join, a Leave, a heartbeat) is corrected there and then. Between
two syncs an expired member's partition may still count as taken when a Join asks for none; a
Join that would be refused for a full job syncs first, so a slot is never refused for that.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from broker.store import MemberStore
from services.common.membership import MemberInfo, client_members, member_id
from services.coordinator.index import MemberIndex


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
    ) -> None:
        self._store = store
        self._job = job
        self._count = count
        self._ttl_s = ttl_s
        self._expired = expired  # told of members found gone, to announce them
        self._clock = clock
        self.index = MemberIndex(count)
        self._synced_at: float | None = None

    def sync(self) -> None:
        """Rebuild the index from one read of all members; announce those gone since."""
        live = client_members(self._store, self._job)
        gone = self.index.clients() - set(live)
        self.index = MemberIndex(self._count, live.values())
        self._synced_at = self._clock()
        if gone:
            self._expired(sorted(gone))

    def sync_if_older(self, age_s: float) -> bool:
        """`sync` unless the last one is younger than `age_s`; whether it ran."""
        if self._synced_at is not None and self._clock() - self._synced_at < age_s:
            return False
        self.sync()
        return True

    def lookup(self, client: str) -> MemberInfo | None:
        """`client`'s record if it is a live member (one read of one member)."""
        found = self._store.member(self._job, member_id(client))
        info = None if found is None else MemberInfo.from_member(found)
        if info is None:
            self._forget([client])
        else:
            self.index.add(info)
        return info

    def renew(self, clients: Sequence[str]) -> list[bool]:
        """Renew the live ones of `clients` (one store step); per client, whether it was."""
        live = self._store.renew_members(self._job, [member_id(c) for c in clients], self._ttl_s)
        self._forget(c for c, renewed in zip(clients, live, strict=True) if not renewed)
        return live

    def record(self, info: MemberInfo) -> None:
        """Write `info` as its client's live record, for the membership TTL."""
        self._store.heartbeat(self._job, member_id(info.client), self._ttl_s, info.to_info())
        self.index.add(info)

    def remove(self, client: str) -> None:
        self._store.remove_member(self._job, member_id(client))
        self.index.discard(client)

    def _forget(self, clients: Iterable[str]) -> None:
        """Drop from the index members the store no longer has: they expired."""
        gone = [client for client in clients if self.index.discard(client) is not None]
        if gone:
            self._expired(gone)
