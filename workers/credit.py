"""Per-client credit on a shard queue: one client's flood must not cost the others their round.

A shard queue is one FIFO for every client of the shard and the round markers, so whatever a
client publishes is consumed ahead of what is queued behind it. The worker cannot reorder the
queue, but it can make a client's excess cheap: a client has at most `allowance` batches
accepted per round, and every batch beyond that is refused unjudged, dead-lettered
`over_budget` in batches (one wait for the broker per `SURPLUS_BATCH`), so a flood drains at
reject speed and never trains the replica. The rule and its measurements: docs/reliability.md,
"Shard queue flood".

The allowance comes from the client's assignment: the steps a client with its samples takes
in a round (`round_steps`, the client's own rule), twice over (the last round's stragglers
come after the RoundStart of the next), plus `SLACK`. A round is what lies between two
RoundStarts (a reopened round starts its count again); in async mode, which has no markers,
the batches computed with one weights version (a client trains one local round per version it
fetched, two when no newer one was out yet), for the versions not too stale to train on.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from broker.transport import Delivery

# Batches beyond twice a round's steps a client may have accepted: a round reopened by a
# straggler's republish, a step barrier's redelivery after a take-over.
SLACK = 8
# The refused are dead-lettered once this many wait, once the oldest has waited this long, or
# when the worker's wait for input ends with nothing. Unsettled, they hold prefetch slots, so
# the batch is kept well under the shard's prefetch (at least 16).
SURPLUS_BATCH = 8
SURPLUS_WAIT_S = 0.02


def round_steps(samples: int, *, batch_size: int, local_epochs: int, max_steps: int) -> int:
    """Steps of a client's round with `samples` training samples (`services.client.data`'s
    `round_batches`: whole epochs of ceil(samples / batch_size) batches, `max_steps` a cap)."""
    total = -(-max(0, samples) // batch_size) * local_epochs
    return min(total, max_steps) if max_steps else total


@dataclass(frozen=True)
class StepRule:
    """The job's step settings, which every client of the round shares."""

    batch_size: int
    local_epochs: int
    max_steps: int

    def allowance(self, samples: int) -> int:
        """Batches a client with `samples` samples may have accepted per round."""
        steps = round_steps(
            samples,
            batch_size=self.batch_size,
            local_epochs=self.local_epochs,
            max_steps=self.max_steps,
        )
        return 2 * steps + SLACK


@dataclass
class Credit:
    """Batches accepted per (client, round key) against their allowance."""

    _spent: dict[tuple[str, int], int] = field(default_factory=dict)

    def spend(self, client: str, key: int, allowance: int) -> bool:
        """Take one batch of `client`'s credit for round `key`; False when it has none left."""
        spent = self._spent.get((client, key), 0)
        if spent >= allowance:
            return False
        self._spent[(client, key)] = spent + 1
        return True

    def new_round(self) -> None:
        """A RoundStart: every client's count starts again."""
        self._spent.clear()

    def forget_before(self, key: int) -> None:
        """Async mode: the counts of versions too stale to train on go."""
        for stale in [k for k in self._spent if k[1] < key]:
            del self._spent[stale]


@dataclass
class Surplus:
    """Refused deliveries waiting to be dead-lettered together, each with its reason."""

    size: int = SURPLUS_BATCH
    wait_s: float = SURPLUS_WAIT_S
    clock: Callable[[], float] = time.monotonic
    letters: list[tuple[Delivery, str]] = field(default_factory=list)
    _since: float = 0.0  # when the oldest came

    def __len__(self) -> int:
        return len(self.letters)

    def add(self, delivery: Delivery, reason: str) -> None:
        if not self.letters:
            self._since = self.clock()
        self.letters.append((delivery, reason))

    def due(self) -> bool:
        """Full, or its oldest has waited long enough."""
        if not self.letters:
            return False
        return len(self.letters) >= self.size or self.clock() - self._since >= self.wait_s

    def take(self) -> list[tuple[Delivery, str]]:
        taken, self.letters = self.letters, []
        return taken
