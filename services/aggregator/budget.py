"""Per-sender budgets on `<job>.updates`: one flooding client must not stall the others.

RabbitMQ hands the queue out in order, so a client's legitimate update queued behind another
client's flood is reached only once the flood ahead of it is consumed. Judging a message
costs little; dead-lettering it with its reason costs a confirmed publish (1.8-2.8 ms per
junk update measured on RabbitMQ on this shared host, ~80% of it waiting for the confirm,
~15% decoding a 2 KB body: 350-570 a second), while one client publishing with confirms
sends 400-1,250 a second: the flood outruns its judge. So each sender gets a token
bucket: within it a message is judged in full (an invalid one dead-lettered with its
reason), beyond it a message is refused unjudged by a nack, which RabbitMQ's own
dead-letter routing moves into `<job>.dead` without a round trip (it carries RabbitMQ's
`x-death`, not our reason header: the reason is logged, once a second per sender). The
aggregator then consumes a flood faster than a client can publish it, the bounded queue
(reject-publish) stays short, and the others' updates are never far behind.

A sender is its AMQP user_id when the broker stamps one (the secured mode), else the client
id it claims if that is a member; every stranger shares one budget, so made-up ids buy no
fresh buckets. A legitimate client sends one update or drop notice per (local) round: the
budget leaves it far more than that.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

# Messages a sender may have judged at once, and per second after that.
BURST = 64
RATE_PER_S = 32.0
# Budget of everyone without an identity of their own (strangers, undecodable bodies).
STRANGERS = ""


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

    def spend(self, sender: str) -> bool:
        """Take one message's worth of `sender`'s budget; False when it has none left."""
        now = self.clock()
        bucket = self._buckets.get(sender)
        if bucket is None:
            bucket = self._buckets[sender] = _Bucket(float(self.burst), now)
        bucket.tokens = min(float(self.burst), bucket.tokens + (now - bucket.at) * self.rate_per_s)
        bucket.at = now
        if bucket.tokens >= 1.0:
            bucket.tokens -= 1.0
            return True
        bucket.refused += 1
        return False

    def report(self, sender: str) -> int:
        """Messages of `sender` refused since the last report, when a report is due (at most
        one a second per sender), else 0."""
        bucket = self._buckets.get(sender)
        now = self.clock()
        if bucket is None or not bucket.refused or now - bucket.reported_at < 1.0:
            return 0
        refused, bucket.refused, bucket.reported_at = bucket.refused, 0, now
        return refused
