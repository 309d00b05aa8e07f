"""Which Joins get a full Welcome: a Welcome carries the client's whole starting weights, so a
Join replayed 500 times must not put 500 of them on its reply queue (issue 33, point 4; the
policy: docs/architecture.md, step 2, **Replayed Joins**).

Per client the coordinator remembers the ids of the Joins it handled and when it last
welcomed which session:

- a Join whose id was handled already (a replay, or a redelivery) is dead-lettered;
- a Join of the session welcomed less than `REWELCOME_S` ago is recorded (its samples and
  classes) but not welcomed again: that Welcome is on its way. Such Joins are the client's own
  retries queued while the coordinator was not up, and the re-Join that reports the samples of
  a partition the Welcome assigned;
- a Join of another session within that time (a client restarted, or back from offline, a
  moment after its Welcome) waits: the coordinator holds the latest such Join per client and
  answers it once the interval is over (`Coordinator._due_joins`).

So one client id costs at most one full Welcome per `REWELCOME_S`, whatever is sent in its
name. The memory is this process's: a restarted coordinator may welcome a session once more.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from enum import Enum

# Shorter than the client's Join retry (5 s), so that a client whose Welcome was lost (its
# reply queue purged, say) is welcomed by its next retry; long enough that a burst of queued
# retries or replays costs one Welcome.
REWELCOME_S = 2.0
# Join ids remembered per client: more than the retries a client sends before it is welcomed.
_IDS_KEPT = 32


class Verdict(Enum):
    WELCOME = "welcome"
    WITHHOLD = "withhold"  # record the Join, send no Welcome: one is on its way
    REPLAYED = "replayed"  # dead-letter: this Join was handled already
    TOO_SOON = "too_soon"  # defer: another session was welcomed a moment ago


@dataclass
class _Welcomed:
    session: str
    at: float
    ids: deque[str] = field(default_factory=lambda: deque(maxlen=_IDS_KEPT))


class WelcomeLimit:
    def __init__(self, clock: Callable[[], float], interval_s: float = REWELCOME_S) -> None:
        self._clock = clock
        self.interval_s = interval_s
        self._clients: dict[str, _Welcomed] = {}

    def judge(self, client: str, join_id: str, session: str, *, member: bool) -> Verdict:
        """What to do with a Join of `session` (the record's session when the Join names none);
        `member`: the client has a live record (without one a Welcome is its only way in)."""
        last = self._clients.get(client)
        if last is None:
            return Verdict.WELCOME
        if join_id in last.ids:
            return Verdict.REPLAYED
        if self._clock() - last.at >= self.interval_s:
            return Verdict.WELCOME
        if session != last.session:
            return Verdict.TOO_SOON
        if not member:
            return Verdict.WELCOME
        last.ids.append(join_id)
        return Verdict.WITHHOLD

    @contextmanager
    def sending(self, client: str, join_id: str, session: str) -> Iterator[None]:
        """Around the send of a Welcome answering `join_id`: recorded if the send returns, as
        of when it began. The client may hold its Welcome before the send returns (the
        broker's confirm comes after the delivery); timed from the return, a Join it sends
        `interval_s` after its Welcome came could find the interval not over."""
        at = self._clock()
        yield
        self._record(client, join_id, session, at)

    def _record(self, client: str, join_id: str, session: str, at: float) -> None:
        last = self._clients.setdefault(client, _Welcomed(session, 0.0))
        last.session = session  # the ids handled stay: a replay of an old session's is one too
        last.at = at
        last.ids.append(join_id)

    def forget(self, client: str) -> None:
        """The client is no member any more (left, expired): its next Join starts afresh."""
        self._clients.pop(client, None)

    @staticmethod
    def replay_reason(client: str, join_id: str) -> str:
        """The dead-letter reason of a REPLAYED Join."""
        return f"replayed_join: Join {join_id} of client {client!r} was answered already"
