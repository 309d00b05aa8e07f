"""Whether a client is a member of the job, and its member record, as the store says, read
sparingly: the worker asks for every SmashedBatch, the store must not see one read per batch.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from broker.keys import CLIENT_MEMBER_PREFIX
from broker.store import Member, MemberKind, MemberStore
from services.common.membership import MemberInfo

# Strangers the member cache remembers at once; the oldest is forgotten first.
_MAX_STRANGERS = 4096
_MEMBER_TTL_S = 2.0
_NEGATIVE_TTL_S = 1.0
# How soon `info(again=True)` may read the store again for one client, and for any: a client's
# new session is read at its first batch whatever other clients asked, while a flood of seqs
# outside any window costs a read a second per member id it names, at most 20 a second.
_CLIENT_REREAD_S = 1.0
_REREAD_S = 0.05


@dataclass(eq=False)
class MemberCache:
    """A hit is trusted for `_MEMBER_TTL_S`, and a miss always asks the store again, unless that
    very client was found missing less than `_NEGATIVE_TTL_S` ago (a stranger flooding the queue
    then costs one store read per id and interval, not one per message). A shard refuses smashed
    data from a stranger, but must never refuse a member's.

    `info` parses a member's record once per read of the store, and only for the clients asked
    about (a job of many members is read as ids).
    """

    store: MemberStore
    job: str
    clock: Callable[[], float]
    _members: dict[str, Member] = field(default_factory=dict)
    _infos: dict[str, MemberInfo | None] = field(default_factory=dict)
    _read_at: float | None = None
    _strangers: OrderedDict[str, float] = field(default_factory=OrderedDict)  # when found missing
    _asked: OrderedDict[str, float] = field(default_factory=OrderedDict)  # `again`, by client

    def __call__(self, client: str) -> bool:
        now = self.clock()
        if client in self._members and self._fresh(now, _MEMBER_TTL_S):
            return True
        missed_at = self._strangers.get(client)
        if missed_at is not None and now - missed_at < _NEGATIVE_TTL_S:
            return False
        return self._read(client, now)

    def info(self, client: str, *, again: bool = False) -> MemberInfo | None:
        """`client`'s member record (None: not a member, or a record that is not a client's).
        `again`: read the store first (the caller saw something the record it has does not
        explain: a new session), unless that client asked less than `_CLIENT_REREAD_S` ago or
        anyone less than `_REREAD_S` ago."""
        now = self.clock()
        if again and self._may_read_again(client, now):
            self._read(client, now)
        elif client not in self._members and not self(client):
            return None
        if client not in self._infos:
            member = self._members.get(client)
            self._infos[client] = None if member is None else MemberInfo.from_member(member)
        return self._infos[client]

    def _may_read_again(self, client: str, now: float) -> bool:
        if (
            self._fresh(now, _REREAD_S)
            or now - self._asked.get(client, -math.inf) < _CLIENT_REREAD_S
        ):
            return False
        self._asked[client] = now
        self._asked.move_to_end(client)
        while len(self._asked) > _MAX_STRANGERS:
            self._asked.popitem(last=False)
        return True

    def _fresh(self, now: float, ttl_s: float) -> bool:
        return self._read_at is not None and now - self._read_at < ttl_s

    def _read(self, client: str, now: float) -> bool:
        members = self.store.live_members(self.job, MemberKind.CLIENT)
        self._members = {m[len(CLIENT_MEMBER_PREFIX) :]: v for m, v in members.items()}
        self._infos = {}
        self._read_at = now
        if client in self._members:
            self._strangers.pop(client, None)
            return True
        self._strangers[client] = now
        self._strangers.move_to_end(client)
        while len(self._strangers) > _MAX_STRANGERS:
            self._strangers.popitem(last=False)
        return False
