"""The aggregator's one view of the job's client members: who is live, and who ever was.

Every read of the members goes through a `MemberBook`, so a client the round driver put in a
cohort is known to the inbox's screen by construction. A member that left (or expired) stays
known for the rest of the run: an update it sent just before is judged as anyone's. A stranger
triggers a re-read, but only so many a second: a flood of made-up client ids must not turn
into a store read per message.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from broker.store import WeightStore
from services.common.membership import MemberInfo, client_members

# Re-reads of the members on a stranger: a burst of this many, then this many a second.
_STRANGER_READS = 20.0


@dataclass
class MemberBook:
    store: WeightStore
    job: str
    clock: Callable[[], float] = time.monotonic
    # Every member seen this run (the newest record of each).
    known: dict[str, MemberInfo] = field(default_factory=dict)
    _tokens: float = _STRANGER_READS
    _tokens_at: float = float("-inf")

    def live(self) -> dict[str, MemberInfo]:
        """The live client members, read from the store now (and remembered)."""
        live = client_members(self.store, self.job)
        self.known.update(live)
        return live

    def get(self, client: str) -> MemberInfo | None:
        """`client`'s record if it is or was a member this run, else None."""
        info = self.known.get(client)
        if info is None and self._may_reread():
            info = self.live().get(client)
        return info

    def _may_reread(self) -> bool:
        now = self.clock()
        elapsed = now - self._tokens_at
        self._tokens = min(_STRANGER_READS, self._tokens + elapsed * _STRANGER_READS)
        self._tokens_at = now
        if self._tokens < 1.0:
            return False
        self._tokens -= 1.0
        return True
