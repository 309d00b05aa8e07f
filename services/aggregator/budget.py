"""Per-sender budgets on `<job>.updates`: one flooding client must not stall the others.

RabbitMQ hands the queue out in order and dead-lettering junk (a confirmed publish each) is
slower than one client publishes it, so without budgets a flood delays every update queued
behind it. The rule (a token bucket per sender: its AMQP user where the broker vouches for
one, else the member a message names; strangers share one, so made-up ids buy no fresh buckets;
the surplus dead-lettered in batches) and its measurements: docs/reliability.md, the flood row.
What a round takes (a member's one update or notice) spends nothing, so junk in a member's name
cannot refuse its real update (the inbox judges first). A legitimate client sends one message
per local round, far below its budget.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from broker.rejection import LetterBatch, Rejection
from broker.transport import Delivery

# Messages a sender may have judged at once, and per second after that.
BURST = 64
RATE_PER_S = 32.0
# Budget of everyone without an identity of their own (strangers, undecodable bodies).
STRANGERS = ""
# Refusal kind (and the reason's head) of a message refused for its sender's budget.
OVER_BUDGET = "over_budget"
# The surplus is dead-lettered once this many wait, or once the oldest has waited this long,
# or when the inbox's wait for input ends with nothing (the inbox flushes it). Unsettled, the
# surplus holds its share of the aggregator's prefetch: at most its slack for late and
# malformed updates beyond a cohort (16), so it never keeps an update out.
SURPLUS_BATCH = 16
SURPLUS_WAIT_S = 0.02


@dataclass
class _Bucket:
    tokens: float
    at: float
    refused: int = 0  # since the last report
    reported_at: float = float("-inf")


@dataclass
class SenderBudgets:
    burst: int = BURST
    rate_per_s: float = RATE_PER_S
    clock: Callable[[], float] = time.monotonic
    _buckets: dict[str, _Bucket] = field(default_factory=dict)
    _pruned_at: float = float("-inf")

    def spend(self, sender: str) -> bool:
        """Take one message's worth of `sender`'s budget; False when it has none left."""
        now = self.clock()
        self._prune(now)
        bucket = self._buckets.setdefault(sender, _Bucket(float(self.burst), now))
        bucket.tokens = min(float(self.burst), bucket.tokens + (now - bucket.at) * self.rate_per_s)
        bucket.at = now
        if bucket.tokens >= 1.0:
            bucket.tokens -= 1.0
            return True
        bucket.refused += 1
        return False

    def _prune(self, now: float) -> None:
        """Forget the senders whose buckets have refilled (a fresh one is the same), once per
        refill time: the buckets held are those of the senders of the last few seconds, not of
        every member that ever sent."""
        refill_s = self.burst / self.rate_per_s
        if now - self._pruned_at < refill_s:
            return
        self._pruned_at = now
        for sender in [s for s, b in self._buckets.items() if now - b.at >= refill_s]:
            del self._buckets[sender]

    def refusal(self, sender: str) -> Rejection:
        """Why a message over `sender`'s budget is refused (dead-lettered `code: detail`)."""
        who = f"sender {sender!r}" if sender else "senders without an identity (one budget)"
        detail = f"{who} above {self.burst} messages then {self.rate_per_s:g}/s that no round took"
        return Rejection(OVER_BUDGET, f"{detail}; refused")

    def report(self, sender: str) -> int:
        """Messages of `sender` refused since the last report, when a report is due (at most
        one a second per sender), else 0."""
        bucket = self._buckets.get(sender)
        now = self.clock()
        if bucket is None or not bucket.refused or now - bucket.reported_at < 1.0:
            return 0
        refused, bucket.refused, bucket.reported_at = bucket.refused, 0, now
        return refused


@dataclass
class Surplus(LetterBatch):
    """Dead letters waiting to go together, each with its reason and what to do once it is
    settled: the over-budget ones, and, while a batch of those is open, the judged ones too
    (during a flood, the flooder's budgeted junk would otherwise cost a confirm each)."""

    size: int = SURPLUS_BATCH
    wait_s: float = SURPLUS_WAIT_S
    settled: list[Callable[[], None]] = field(default_factory=list)  # letter by letter

    def add_settled(self, delivery: Delivery, reason: str, settled: Callable[[], None]) -> bool:
        """Keep one; whether the batch is due (full, or its oldest has waited long enough)."""
        self.settled.append(settled)
        return self.add(delivery, reason)

    def take(self) -> tuple[list[tuple[Delivery, str]], list[Callable[[], None]]]:
        settled, self.settled = self.settled, []
        return self.take_letters(), settled
