"""Which WeightsUpdates a round takes: the verdict on each one (pure, no broker).

An `OpenRound` accepts one update per cohort member, for its round and version, or that
member's `RoundDropped` notice (it stops waiting for the member and counts the reason); a
`ClosedGate` stands in between rounds, when every update or notice is either late (its round
is over) or premature. A gate sees only what the inbox's screen let through
(`services.aggregator.screen`: a member's message, an update with the model's tensors); the
helpers that check tensors live here, for the screen and the gates' copies alike.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

import torch

from broker.messages import RoundDropped, WeightsUpdate
from services.aggregator.cohort import quorum_size
from services.algorithms.base import ClientUpdate
from services.common.membership import MemberInfo, same_incarnation


class Verdict(enum.Enum):
    ACCEPT = "accept"
    DUPLICATE = "duplicate"  # a second update of one client for one round: ignored
    LATE = "late"  # valid but its round has closed: answered with round_closed
    REJECT = "reject"  # dead-lettered with the reason


@dataclass(frozen=True)
class Offer:
    verdict: Verdict
    reason: str = ""
    # The Error code a LATE update is answered with (async mode: "too_stale").
    code: str = "round_closed"
    # What kind of refusal a REJECT is, counted per round attempt (`services.aggregator.empty`).
    kind: str = "rejected"


class Decision(enum.Enum):
    WAIT = "wait"
    CLOSE = "close"
    REOPEN = "reopen"  # nothing arrived: sample a new cohort for the same round


@dataclass(frozen=True)
class TensorSpec:
    shape: tuple[int, ...]
    dtype: torch.dtype


Reference = Mapping[str, TensorSpec]


def reference_of(state: Mapping[str, torch.Tensor]) -> dict[str, TensorSpec]:
    return {name: TensorSpec(tuple(t.shape), t.dtype) for name, t in state.items()}


def weights_problem(
    weights: Mapping[str, torch.Tensor], reference: Reference, what: str, *, subset: bool
) -> str | None:
    """Why `weights` do not fit `reference` (None when they do). `subset` allows missing names
    (aux heads: a client holds only the heads it trains)."""
    unknown = sorted(set(weights) - set(reference))
    missing = [] if subset else sorted(set(reference) - set(weights))
    if unknown or missing:
        return f"{what}: unknown tensors {unknown[:3]}, missing tensors {missing[:3]}"
    for name, tensor in weights.items():
        spec = reference[name]
        if tuple(tensor.shape) != spec.shape:
            return f"{what}.{name}: shape {list(tensor.shape)}, expected {list(spec.shape)}"
        if tensor.is_floating_point() != spec.dtype.is_floating_point:
            return f"{what}.{name}: dtype {tensor.dtype}, expected {spec.dtype}"
    return None


def masks_problem(
    masks: Mapping[str, torch.Tensor], weights: Mapping[str, torch.Tensor]
) -> str | None:
    """Why `masks` (Sub-FedAvg) do not fit the update's own `weights`: each must mask one of
    them, with its shape."""
    for name, mask in masks.items():
        tensor = weights.get(name)
        if tensor is None:
            return f"masks.{name}: no such tensor in client_weights"
        if mask.shape != tensor.shape:
            return f"masks.{name}: shape {list(mask.shape)}, the weights have {list(tensor.shape)}"
    return None


class Gate(Protocol):
    def offer(self, update: WeightsUpdate) -> Offer: ...

    def offer_drop(self, drop: RoundDropped) -> Offer: ...

    def refused(self, client: str) -> None:
        """A member's update the screen refused (dead-lettered already)."""


@dataclass(frozen=True)
class ClosedGate:
    """Between rounds: updates of round <= `last` are late, later ones premature."""

    last: int

    def offer(self, update: WeightsUpdate) -> Offer:
        if update.round <= self.last:
            return Offer(Verdict.LATE, f"round {update.round} is closed")
        return Offer(Verdict.REJECT, f"round {update.round} is not open", kind="not_open")

    def offer_drop(self, drop: RoundDropped) -> Offer:
        if drop.round <= self.last:
            return Offer(Verdict.LATE, f"round {drop.round} is closed")
        return Offer(Verdict.REJECT, f"round {drop.round} is not open", kind="not_open")

    def refused(self, client: str) -> None:
        pass  # counted by the inbox, per attempt


def _cast(state: Mapping[str, torch.Tensor], reference: Reference) -> dict[str, torch.Tensor]:
    """Copies in the version's dtypes (a client may send float16; the decoded tensors are views
    of the message body)."""
    return {n: t.to(dtype=reference[n].dtype, copy=True) for n, t in state.items()}


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
        misplaced = self._misplaced(update.round, update.client)
        if misplaced is not None:
            return misplaced
        if update.client in self.updates:
            return Offer(Verdict.DUPLICATE)
        problem = self._problem(update)
        if problem is not None:
            return problem
        # A valid update outweighs an earlier notice that the round was dropped.
        self.declined.pop(update.client, None)
        self.updates[update.client] = ClientUpdate(
            client=update.client,
            samples=update.samples,
            base_version=update.version,
            client_weights=_cast(update.client_weights, self.client_ref),
            aux_weights=_cast(update.aux_weights, self.aux_ref),
            masks={n: m.clone() for n, m in update.masks.items()},
            metrics=dict(update.metrics),
        )
        return Offer(Verdict.ACCEPT)

    def offer_drop(self, drop: RoundDropped) -> Offer:
        """A member's notice that it dropped this round: no longer awaited, and its reason
        counts when the attempt ends without a valid update."""
        misplaced = self._misplaced(drop.round, drop.client)
        if misplaced is not None:
            return misplaced
        if drop.client in self.updates:
            reason = f"client {drop.client!r} already sent its update for round {self.round}"
            return Offer(Verdict.REJECT, reason, kind="contradicts_update")
        if drop.client in self.declined:
            return Offer(Verdict.DUPLICATE)
        if drop.version != self.version:
            reason = (
                f"RoundDropped based on version {drop.version}; "
                f"round {self.round} trains version {self.version}"
            )
            return Offer(Verdict.REJECT, reason, kind="wrong_version")
        expected = self.assigned.get(drop.client)
        if drop.ref_message_id and expected and drop.ref_message_id != expected:
            return Offer(Verdict.LATE, f"it answers an earlier assignment of round {self.round}")
        self.declined[drop.client] = drop.reason
        return Offer(Verdict.ACCEPT, kind=drop.reason)

    def _misplaced(self, round_index: int, client: str) -> Offer | None:
        """The verdict on an update or notice not for this round's cohort, or None."""
        if round_index < self.round:
            return Offer(Verdict.LATE, f"round {round_index} is closed")
        if round_index > self.round:
            reason = f"round {round_index} is not open (open: {self.round})"
            return Offer(Verdict.REJECT, reason, kind="not_open")
        if client not in self.cohort:
            if client in self.earlier:
                return Offer(Verdict.LATE, f"round {self.round} was reopened without you")
            reason = f"client {client!r} is not in round {self.round}"
            return Offer(Verdict.REJECT, reason, kind="not_in_cohort")
        return None

    def _problem(self, update: WeightsUpdate) -> Offer | None:
        """The refusal of a cohort member's (screened) update for this round, or None."""
        if update.version != self.version:
            reason = (
                f"update based on version {update.version}; "
                f"round {self.round} trains version {self.version}"
            )
            return Offer(Verdict.REJECT, reason, kind="wrong_version")
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
