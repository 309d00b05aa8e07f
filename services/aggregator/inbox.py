"""The aggregator's side of `<job>.updates`: decode, check (the sender's checks, then the
screen's of a member's update: services/common/checks, `gate`), hand to the clock's gate; then
what the gate did not take spends its sender's budget (`budget`) before it is acked, answered
or dead-lettered. Validation comes before state, so every invalid message is dead-lettered with
its reason, in both modes.

Accepted updates stay unacknowledged until the version they go into is published, so an
aggregator that dies mid-round loses no update. A `RoundDropped` notice is acked once judged:
it carries nothing to aggregate, and held ones would eat the prefetch across reopened attempts
(a successor that never saw it waits for that member until the deadline).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from broker.codec import decode
from broker.errors import DecodeError
from broker.messages import Message, RoundDropped, WeightsUpdate
from broker.rejection import (
    Rejected,
    Rejection,
    ack_safely,
    dead_letter_many_safely,
    dead_letter_safely,
)
from broker.topology import updates_queue_name
from broker.transport import Broker, Delivery
from services.aggregator.budget import OVER_BUDGET, STRANGERS, SenderBudgets, Surplus
from services.aggregator.gate import NOT_MEMBER, Gate, Offer, UpdateScreen, Verdict
from services.common.checks.addressing import SameJob, wrong_type
from services.common.checks.chain import Check, first_rejection
from services.common.checks.membership import Membership
from services.common.checks.sender import ClientIdShape, ClientSender
from services.common.outbox import Outbox
from services.metrics.recorder import NO_METRICS, Metrics
from services.security.identity import SenderCheck


@dataclass
class InboxStats:
    accepted: int = 0
    duplicates: int = 0
    late: int = 0
    dead_lettered: int = 0
    accepted_bytes: int = 0
    drops: int = 0  # RoundDropped notices taken (not their duplicates, late or refused ones)
    throttled: int = 0  # refused (no round took them) while their sender was over its budget


@dataclass(frozen=True)
class _Ruling:
    """What the inbox makes of one delivery."""

    offer: Offer
    # Whose budget a message without an AMQP user spends: the member it names once the screen
    # knows it, else the strangers' one.
    member: str = STRANGERS
    # The update or notice the gate judged (None: refused before the gate, by `offer`).
    judged: WeightsUpdate | RoundDropped | None = None
    # What follows its dead letter (a member's unusable update: the gate is told).
    then: Callable[[], None] | None = None

    @classmethod
    def refused(cls, rejection: Rejection) -> _Ruling:
        """Refused before the gate: a stranger's (the strangers' budget)."""
        return cls(_offer(rejection))


@dataclass
class UpdateInbox:
    broker: Broker
    outbox: Outbox
    job: str
    logger: logging.Logger
    screen: UpdateScreen = field(kw_only=True)
    stats: InboxStats = field(default_factory=InboxStats)
    held: list[Delivery] = field(default_factory=list)
    metrics: Metrics = NO_METRICS
    senders: SenderCheck = field(default_factory=SenderCheck)
    # Dead-lettered updates by kind (`refusal_kind`) since the round driver last cleared it:
    # why an attempt at a round got no valid update.
    refusals: Counter[str] = field(default_factory=Counter)
    budgets: SenderBudgets = field(default_factory=SenderBudgets)
    surplus: Surplus = field(default_factory=Surplus)
    # A message's checks before the screen's: its job, its sender, whether it is a member.
    checks: tuple[Check[WeightsUpdate | RoundDropped], ...] = field(init=False)

    def __post_init__(self) -> None:
        self.checks = (
            SameJob(self.job, "update for job {got!r}"),
            ClientIdShape(BAD_SENDER),
            ClientSender(self.senders, BAD_SENDER),
            Membership(self.screen.members.knows, NOT_MEMBER),
        )

    def poll(self, timeout: float, gate: Gate, version: int) -> bool:
        """Handle at most one delivery (waiting up to `timeout`); whether there was one.
        `version` is the current version, quoted in round_closed errors."""
        # Waiting for input, the surplus is let grow for at most its age limit (one batch, one
        # wait for the broker); a wait that ends empty-handed leaves nothing unsettled.
        wait = min(timeout, self.surplus.time_left()) if self.surplus else timeout
        delivery = self.broker.get(wait)
        if delivery is None and self.surplus:
            self.flush()
            if wait < timeout:
                delivery = self.broker.get(timeout - wait)
        if delivery is None:
            return False
        ruling = self._rule(delivery, _decoded(delivery), gate, version)
        # Validate before charging: what the gate takes (a member's one update or notice of a
        # round) is never refused for a budget, so junk in a member's name cannot cost it its
        # round; the rest spends its sender's budget before anything more is done for it.
        if ruling.offer.verdict is not Verdict.ACCEPT:
            sender = delivery.user_id or ruling.member
            if not self.budgets.spend(sender):
                refused = self.budgets.refusal(sender)
                self._batch(delivery, refused.reason, lambda: self._throttled(sender))
                return True
        if ruling.judged is not None:
            self._settle(delivery, ruling.judged, ruling.offer, version)
        else:
            self._dead_letter(delivery, ruling.offer.reason, ruling.offer.kind, ruling.then)
        return True

    def _rule(
        self, delivery: Delivery, message: Message | DecodeError, gate: Gate, version: int
    ) -> _Ruling:
        """The checks in order (decode, type, `checks`, a member's update: the screen's), then
        the gate's verdict."""
        if isinstance(message, DecodeError):
            reason = message.reason
            return _Ruling.refused(Rejection(decode_kind(reason), f"undecodable: {reason}"))
        if not isinstance(message, WeightsUpdate | RoundDropped):
            return _Ruling.refused(wrong_type(message, updates_queue_name(self.job)))
        rejection = first_rejection(self.checks, delivery, message)
        if rejection is not None:
            return _Ruling.refused(rejection)
        # Past the checks the client is a member (or was one lately): its name is the budget
        # an unstamped message spends (the open mode cannot tell it from a forgery, which is
        # why what the gate takes spends none).
        client = message.client
        if isinstance(message, RoundDropped):
            return _Ruling(gate.offer_drop(message), member=client, judged=message)
        rejection = first_rejection(self.screen.checks, delivery, message)
        if rejection is not None:  # a member's unusable update: its round may count it
            return _Ruling(_offer(rejection), member=client, then=lambda: gate.refused(client))
        self.metrics.staleness(version - message.version)
        return _Ruling(gate.offer(message), member=client, judged=message)

    def flush(self) -> None:
        """Dead-letter the batch (the surplus, and what was judged meanwhile) in one go."""
        letters, settled = self.surplus.take()
        if letters:
            for outcome, then in zip(
                dead_letter_many_safely(self.broker, letters), settled, strict=True
            ):
                if outcome is not Rejected.REDELIVERED:  # else it comes back, judged again
                    then()

    def _batch(self, delivery: Delivery, reason: str, settled: Callable[[], None]) -> None:
        if self.surplus.add_settled(delivery, reason, settled):
            self.flush()

    def _throttled(self, sender: str) -> None:
        self.stats.throttled += 1
        self.refusals[OVER_BUDGET] += 1
        refused = self.budgets.report(sender)
        if refused:
            self.logger.warning(
                "job %s: %s is over its budget of %d updates, then %g a second: %d that no "
                "round took refused (dead-lettered with that reason) since the last report",
                self.job,
                f"client {sender!r}" if sender else "an unknown sender",
                self.budgets.burst,
                self.budgets.rate_per_s,
                refused,
            )

    def _settle(
        self, delivery: Delivery, message: WeightsUpdate | RoundDropped, offer: Offer, version: int
    ) -> None:
        """Act on a gate's verdict. An accepted update is held until its version is published;
        a late one is answered with an Error (a late drop notice needs no answer: the client
        has moved on); everything but a refusal is acked."""
        if offer.verdict is Verdict.REJECT:
            self._dead_letter(delivery, offer.reason, offer.kind)
            return
        if offer.verdict is Verdict.ACCEPT:
            if isinstance(message, WeightsUpdate):
                self.stats.accepted += 1
                self.stats.accepted_bytes += len(delivery.body)
                self.held.append(delivery)
                return
            self.stats.drops += 1
            self.logger.info(
                "job %s: %s dropped round %d (%s): %s",
                self.job,
                message.client,
                message.round + 1,
                message.reason,
                message.detail or "no detail",
            )
        elif offer.verdict is Verdict.DUPLICATE:
            self.stats.duplicates += 1
        else:
            self.stats.late += 1
            self.logger.info(
                "job %s: late %s from %s for round %d: %s",
                self.job,
                type(message).__name__,
                message.client,
                message.round + 1,
                offer.reason,
            )
            if isinstance(message, WeightsUpdate) and not self.outbox.error(
                message.client, version, offer.code, offer.reason, message.message_id
            ):  # a stranger's (no reply queue): nobody to tell, so nothing was handled
                reason = f"{offer.reason}; client {message.client!r} unknown"
                self._dead_letter(delivery, reason, "unknown_client")
                return
        self._ack(delivery)

    def drain(self, gate: Gate, version: int) -> None:
        """Handle every delivery already waiting, without blocking."""
        while self.poll(0.0, gate, version):
            pass

    def release(self) -> None:
        """Ack the held updates: their round is published (or settled otherwise)."""
        held, self.held = self.held, []
        for delivery in held:
            self._ack(delivery)

    def _ack(self, delivery: Delivery) -> None:
        if not ack_safely(self.broker, delivery):
            # The connection dropped meanwhile: the broker redelivers it, and it will be late.
            self.logger.info("job %s: ack of an update on a lost connection", self.job)

    def _dead_letter(
        self, delivery: Delivery, reason: str, kind: str, then: Callable[[], None] | None = None
    ) -> None:
        """Dead-letter with `reason`; once settled, count it and run `then` (not when its
        connection is gone: it comes back and is judged again). During a flood (a batch of
        surplus open) it joins the batch."""

        def settled() -> None:
            self.stats.dead_lettered += 1
            self.refusals[kind] += 1
            self.logger.warning("job %s: dead-lettering an update: %s", self.job, reason)
            if then is not None:
                then()

        if self.surplus:
            self._batch(delivery, reason, settled)
        elif dead_letter_safely(self.broker, delivery, reason) is not Rejected.REDELIVERED:
            settled()


# Refusal kind of a message whose client id or AMQP user is not what it claims.
BAD_SENDER = "bad_sender"


def _offer(rejection: Rejection) -> Offer:
    """A check's rejection as the gate's REJECT (dead-lettered with the detail alone)."""
    return Offer(Verdict.REJECT, rejection.detail, kind=rejection.code)


def _decoded(delivery: Delivery) -> Message | DecodeError:
    try:
        return decode(delivery.body)
    except DecodeError as exc:
        return exc


def decode_kind(reason: str) -> str:
    """The refusal kind of an undecodable update: `non_finite` when its weights hold NaN or
    infinities (a client whose model diverged), else `undecodable`."""
    # The codec's wording (broker/tensors.py, broker/codec.py); a test pins it end to end.
    return "non_finite" if "NaN or infinite" in reason else "undecodable"
