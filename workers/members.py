"""Whether a client is a member of the job, as the store says, read sparingly.

A shard refuses smashed data from a stranger, but must never refuse a member's: a hit is
trusted for `_TTL_S`, and a miss always asks the store again, unless that very client was found
missing less than `_NEGATIVE_TTL_S` ago (a stranger flooding the queue then costs one store
read per id and interval, not one per message).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from broker.keys import CLIENT_MEMBER_PREFIX
from broker.store import MemberKind, MemberStore

# Strangers remembered at once; the oldest is forgotten first.
_MAX_STRANGERS = 4096
_TTL_S = 2.0
_NEGATIVE_TTL_S = 1.0


@dataclass(eq=False)
class MemberCache:
    store: MemberStore
    job: str
    clock: Callable[[], float]
    _members: frozenset[str] = frozenset()
    _read_at: float | None = None
    _strangers: OrderedDict[str, float] = field(default_factory=OrderedDict)  # when found missing

    def __call__(self, client: str) -> bool:
        now = self.clock()
        fresh = self._read_at is not None and now - self._read_at < _TTL_S
        if client in self._members and fresh:
            return True
        missed_at = self._strangers.get(client)
        if missed_at is not None and now - missed_at < _NEGATIVE_TTL_S:
            return False
        members = self.store.live_members(self.job, MemberKind.CLIENT)
        self._members = frozenset(m[len(CLIENT_MEMBER_PREFIX) :] for m in members)
        self._read_at = now
        if client in self._members:
            self._strangers.pop(client, None)
            return True
        self._strangers[client] = now
        self._strangers.move_to_end(client)
        while len(self._strangers) > _MAX_STRANGERS:
            self._strangers.popitem(last=False)
        return False
