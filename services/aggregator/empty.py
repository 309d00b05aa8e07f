"""Attempts at a round that got no valid update, and when they end the job.

A sync round that gets no valid update is reopened with a fresh cohort (a member may have been
unlucky). When its clients' models diverged, though, every attempt ends the same way: each
client refuses to send NaN weights and says so (`RoundDropped`, reason `non_finite`), or sends
an update that is dead-lettered as non-finite, and the job would reopen the round for ever.
So `rounds.max_empty_attempts` attempts in a row without one valid update fail the job, with
the reasons of the last one.

An attempt whose whole cohort left (expired, no reply queue) does not count, whatever was
refused meanwhile (garbage from strangers is refused too): the aggregator then waits for members
to come back, which is churn, not a broken job.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field

from services.aggregator.gate import OpenRound

# Refusal kind of a cohort member that sent nothing the aggregator could judge.
NO_UPDATE = "no_update"
# Refusal kind of a cohort member that left during the attempt (expired, no reply queue).
GONE = "gone"


@dataclass(frozen=True)
class EmptyAttempt:
    """Why one attempt at a round ended without a valid update."""

    # Updates dead-lettered during the attempt, by kind (`UpdateInbox.refusals`).
    refusals: Mapping[str, int]
    awaited: int  # cohort members that stayed to the end and sent nothing valid
    gone: int  # cohort members that left during the attempt
    # Members that said they dropped the round (`RoundDropped`), by reason.
    declined: Mapping[str, int] = field(default_factory=dict)

    @classmethod
    def of(cls, state: OpenRound, refusals: Mapping[str, int]) -> EmptyAttempt:
        refused = {kind: n for kind, n in refusals.items() if n > 0}
        declined = dict(Counter(state.declined.values()))
        return cls(refused, len(state.waiting()), len(state.dropped), declined)

    @property
    def silent(self) -> int:
        """Members awaited, less the updates refused: those that sent nothing at all (not even
        a `RoundDropped`: a client that hung, or one of another make). Undecodable updates name
        no sender, so this is a count, not a list."""
        return max(0, self.awaited - sum(self.refusals.values()))

    @property
    def counts(self) -> bool:
        """Whether it counts towards `max_empty_attempts` (see the module's docstring): some
        member stayed to the end, or said why it had nothing to send."""
        return self.awaited > 0 or sum(self.declined.values()) > 0

    def reasons(self) -> str:
        """E.g. `non_finite ×4, no_update ×1`: the most frequent first. A declared drop and a
        refused update of one kind count together (both mean, e.g., a diverged model)."""
        kinds = Counter(self.refusals)
        kinds.update(self.declined)
        parts = sorted(kinds.items(), key=lambda item: (-item[1], item[0]))
        parts += [(NO_UPDATE, self.silent), (GONE, self.gone)]
        return ", ".join(f"{kind} ×{n}" for kind, n in parts if n > 0) or "none"


@dataclass
class EmptyStreak:
    """Consecutive empty attempts at the round in progress (a closed round resets it)."""

    limit: int  # 0: never fail
    count: int = 0

    def add(self, attempt: EmptyAttempt) -> bool:
        """Note `attempt`; whether the job must fail now."""
        if attempt.counts:
            self.count += 1
        return self.limit > 0 and self.count >= self.limit

    def failure(self, round_index: int, attempt: EmptyAttempt) -> str:
        return (
            f"{self.count} consecutive attempts at round {round_index} without one valid "
            f"update; last reasons: {attempt.reasons()}"
        )
