"""The sync clock's pure parts: who takes part in a round, the verdict on each update (a gate
sees only what the inbox's screen let through), when the round closes, and when attempts
without a valid update end the job (docs/reliability.md, **A round without one valid update**).
"""

from __future__ import annotations

import enum
import math
import random
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from broker.messages import RoundDropped, WeightsUpdate
from services.aggregator.gate import Offer, Reference, Verdict, client_update
from services.algorithms.base import ClientUpdate
from services.common.membership import MemberInfo, same_incarnation

# Refusal kind of a cohort member that sent nothing the aggregator could judge.
NO_UPDATE = "no_update"
# Refusal kind of a cohort member that left during the attempt (expired, no reply queue).
GONE = "gone"


def sample_cohort(
    clients: Iterable[str], size: int, *, seed: int, round_index: int, attempt: int = 0
) -> list[str]:
    """A seeded sample of `size` of `clients` (at least one, at most all), sorted.

    The draw depends only on the seed, the round, the attempt and the set of clients (not
    their order), so a rerun of a job samples the same cohorts.
    """
    pool = sorted(set(clients))
    if not pool:
        return []
    rng = random.Random(f"splitmq-cohort/{seed}/{round_index}/{attempt}")
    return sorted(rng.sample(pool, min(len(pool), max(1, size))))


def round_half_up(x: float) -> int:
    return math.floor(x + 0.5)


def quorum_size(cohort: int, quorum: float) -> int:
    """Reports needed to close at the deadline: `ceil(quorum * cohort)`, at least one."""
    # The epsilon keeps 0.5 * 4 at 2 despite float error in the product.
    return max(1, math.ceil(quorum * cohort - 1e-9))


class Decision(enum.Enum):
    WAIT = "wait"
    CLOSE = "close"
    REOPEN = "reopen"  # nothing arrived: sample a new cohort for the same round


def wrong_version(message: WeightsUpdate | RoundDropped) -> Offer | None:
    """The REJECT of a sync update or notice whose version is not its round's (round r trains
    version r + 1), else None. Checked before a message is taken as late: a late one is acked
    (an update answered), so junk in a member's name must not pass as one."""
    if message.version == message.round + 1:
        return None
    what = "update" if isinstance(message, WeightsUpdate) else "RoundDropped"
    reason = (
        f"{what} based on version {message.version}; "
        f"round {message.round + 1} trains version {message.round + 1}"
    )
    return Offer(Verdict.REJECT, reason, kind="wrong_version")


@dataclass(frozen=True)
class ClosedGate:
    """Between rounds: updates of round <= `last` are late, later ones premature."""

    last: int

    def offer(self, update: WeightsUpdate | RoundDropped) -> Offer:
        if update.round > self.last:
            reason = f"round {update.round + 1} is not open"
            return Offer(Verdict.REJECT, reason, kind="not_open")
        return wrong_version(update) or Offer(Verdict.LATE, f"round {update.round + 1} is closed")

    offer_drop = offer

    def refused(self, client: str) -> None:
        pass  # counted by the inbox, per attempt


@dataclass
class OpenRound:
    round: int
    version: int
    cohort: Mapping[str, MemberInfo]
    opened_at: float
    deadline_s: float
    quorum: float
    client_ref: Reference
    aux_ref: Reference
    # Members of earlier, abandoned attempts at this round: their updates are late.
    earlier: frozenset[str] = frozenset()
    updates: dict[str, ClientUpdate] = field(default_factory=dict)
    # Members gone (left, expired, or rejoined as a new process) and no longer waited for.
    dropped: set[str] = field(default_factory=set)
    # Members that said they dropped this attempt (`RoundDropped`), with the reason.
    declined: dict[str, str] = field(default_factory=dict)
    # The message id of each member's WeightsAssignment of this attempt (a notice that answers
    # another one belongs to an earlier attempt, or to a predecessor aggregator's).
    assigned: dict[str, str] = field(default_factory=dict)

    def offer(self, update: WeightsUpdate) -> Offer:
        if (misplaced := self._misplaced(update)) is not None:
            return misplaced
        if update.client in self.updates:
            return Offer(Verdict.DUPLICATE)
        # A valid update outweighs an earlier notice that the round was dropped.
        self.declined.pop(update.client, None)
        self.updates[update.client] = client_update(update, self.client_ref, self.aux_ref)
        return Offer(Verdict.ACCEPT)

    def offer_drop(self, drop: RoundDropped) -> Offer:
        """A member's notice that it dropped this round: no longer awaited, and its reason
        counts when the attempt ends without a valid update."""
        if (misplaced := self._misplaced(drop)) is not None:
            return misplaced
        if drop.client in self.updates:
            reason = f"client {drop.client!r} already sent its update for round {self.round + 1}"
            return Offer(Verdict.REJECT, reason, kind="contradicts_update")
        if drop.client in self.declined:
            return Offer(Verdict.DUPLICATE)
        expected = self.assigned.get(drop.client)
        if drop.ref_message_id and expected and drop.ref_message_id != expected:
            return Offer(
                Verdict.LATE, f"it answers an earlier assignment of round {self.round + 1}"
            )
        self.declined[drop.client] = drop.reason
        return Offer(Verdict.ACCEPT, kind=drop.reason)

    def _misplaced(self, message: WeightsUpdate | RoundDropped) -> Offer | None:
        """The verdict on an update or notice not for this round's cohort, or None."""
        if message.round > self.round:
            reason = f"round {message.round + 1} is not open (open: {self.round + 1})"
            return Offer(Verdict.REJECT, reason, kind="not_open")
        if (wrong := wrong_version(message)) is not None:
            return wrong
        if message.round < self.round:
            return Offer(Verdict.LATE, f"round {message.round + 1} is closed")
        if message.client not in self.cohort:
            if message.client in self.earlier:
                return Offer(Verdict.LATE, f"round {self.round + 1} was reopened without you")
            reason = f"client {message.client!r} is not in round {self.round + 1}"
            return Offer(Verdict.REJECT, reason, kind="not_in_cohort")
        return None

    def refused(self, client: str) -> None:
        pass  # counted by the inbox, per attempt

    def waiting(self) -> set[str]:
        """Cohort members whose update has not arrived, who did not say they dropped the
        round, and who are still live."""
        return set(self.cohort) - set(self.updates) - set(self.declined) - self.dropped

    def drop(self, live: Mapping[str, MemberInfo]) -> list[str]:
        """Stop waiting for members that are no longer `live`, or live as another process
        than the one assigned (it left or was killed, and joined again between two reads of
        the members: the new process never saw this round's assignment); the ones dropped
        now. An update that arrives all the same still counts."""
        gone = sorted(
            c for c in self.waiting() if not same_incarnation(self.cohort[c], live.get(c))
        )
        self.dropped.update(gone)
        return gone

    def decide(self, now: float) -> Decision:
        received = len(self.updates)
        if not self.waiting():
            return Decision.CLOSE if received else Decision.REOPEN
        elapsed = now - self.opened_at
        if elapsed >= self.deadline_s and received >= quorum_size(len(self.cohort), self.quorum):
            return Decision.CLOSE
        if elapsed >= 2 * self.deadline_s:
            # Below quorum even at twice the deadline: better a smaller round than a stall.
            return Decision.CLOSE if received else Decision.REOPEN
        return Decision.WAIT


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
        """Whether it counts towards `max_empty_attempts`: some member stayed to the end, or
        said why it had nothing to send (a cohort that all left is churn)."""
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
            f"{self.count} consecutive attempts at round {round_index + 1} without one valid "
            f"update; last reasons: {attempt.reasons()}"
        )
