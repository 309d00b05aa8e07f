"""Rejecting a delivery so that neither the rejection nor its settlement can crash a consumer
(what becomes of it: docs/reliability.md, "Bad input"). `dead_letter_many_safely` does the same
for a batch, waiting for the broker once for all of it (a flood's surplus). `Rejection` is why
a delivery is refused, as every role's checks say it (services/common/checks); `Rejected` is
what became of it.
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from broker.errors import BrokerError, StaleDeliveryError
from broker.transport import Broker, Delivery

_log = logging.getLogger("splitmq.broker")


@dataclass(frozen=True, slots=True)
class Rejection:
    """Why a delivery is refused: `code` names the kind (the worker's counter key, the
    aggregator's refusal kind of a round attempt) and `detail` says what is wrong."""

    code: str
    detail: str

    @property
    def reason(self) -> str:
        """The dead-letter reason `"<code>: <detail>"` (the worker's; the aggregator and the
        coordinator dead-letter with the detail alone)."""
        return f"{self.code}: {self.detail}"


class Rejected(enum.Enum):
    DEAD_LETTERED = "dead-lettered"  # in the dead-letter queue with its reason
    # The copy was refused (dead-letter queue full, gone for good, no permission): nacked
    # without requeue, so the queue's own dead-letter routing takes it, without our header.
    WITHOUT_REASON = "without reason"
    REDELIVERED = "redelivered"  # its connection was gone: it comes back and is judged again


def dead_letter_safely(broker: Broker, delivery: Delivery, reason: str) -> Rejected:
    """Dead-letter `delivery` with `reason`; says what became of it."""
    try:
        broker.dead_letter(delivery, reason)
    except StaleDeliveryError:
        return Rejected.REDELIVERED
    except BrokerError as exc:
        _log.warning(
            "could not dead-letter a message from %s with its reason (%s); rejecting it to "
            "the queue's own dead-letter routing instead: %s",
            delivery.queue,
            exc,
            reason,
        )
        return _without_reason(broker, delivery)
    return Rejected.DEAD_LETTERED


def dead_letter_many_safely(
    broker: Broker, letters: Sequence[tuple[Delivery, str]]
) -> list[Rejected]:
    """Dead-letter each (delivery, reason) as `dead_letter_safely` does, in one batch; what
    became of each, in order."""
    try:
        unsettled = broker.dead_letter_many(letters)
    except BrokerError as exc:  # nothing settled: each falls back (a usage error raises again)
        unsettled = [(delivery, exc) for delivery, _ in letters]
    outcome = {id(delivery): Rejected.DEAD_LETTERED for delivery, _ in letters}
    refused: list[tuple[Delivery, BrokerError]] = []
    for delivery, why in unsettled:
        if isinstance(why, StaleDeliveryError):
            outcome[id(delivery)] = Rejected.REDELIVERED
        else:
            refused.append((delivery, why))
    if refused:
        reasons = {id(delivery): reason for delivery, reason in letters}
        _log.warning(
            "could not dead-letter %d message(s) from %s with their reasons (%s); rejecting "
            "them to the queue's own dead-letter routing instead: %s",
            len(refused),
            ", ".join(sorted({delivery.queue for delivery, _ in refused})),
            refused[0][1],
            "; ".join(sorted({reasons[id(delivery)] for delivery, _ in refused})),
        )
    for delivery, _ in refused:
        outcome[id(delivery)] = _without_reason(broker, delivery)
    return [outcome[id(delivery)] for delivery, _ in letters]


def _without_reason(broker: Broker, delivery: Delivery) -> Rejected:
    """Nack without requeue: the queue's own dead-letter routing takes it."""
    try:
        broker.nack(delivery, requeue=False)
    except StaleDeliveryError:
        return Rejected.REDELIVERED
    return Rejected.WITHOUT_REASON


def ack_safely(broker: Broker, delivery: Delivery) -> bool:
    """Ack; False when the delivery's connection is gone (the broker redelivers it)."""
    try:
        broker.ack(delivery)
    except StaleDeliveryError:
        return False
    return True


@dataclass
class LetterBatch:
    """Refused deliveries waiting to be dead-lettered together (`dead_letter_many_safely`), each
    with its reason: a flood's refusals then cost one wait for the broker per batch, not one per
    message. Due when `size` wait or the oldest has waited `wait_s`."""

    size: int = 8
    wait_s: float = 0.02
    clock: Callable[[], float] = time.monotonic
    letters: list[tuple[Delivery, str]] = field(default_factory=list)
    _since: float = 0.0  # when the oldest came

    def __len__(self) -> int:
        return len(self.letters)

    def add(self, delivery: Delivery, reason: str) -> bool:
        """Keep one; whether the batch is due now."""
        if not self.letters:
            self._since = self.clock()
        self.letters.append((delivery, reason))
        return self.due()

    def due(self) -> bool:
        """Full, or its oldest has waited long enough."""
        if not self.letters:
            return False
        return len(self.letters) >= self.size or self.clock() - self._since >= self.wait_s

    def time_left(self) -> float:
        """How long the oldest may wait yet."""
        return max(0.0, self.wait_s - (self.clock() - self._since)) if self.letters else 0.0

    def take_letters(self) -> list[tuple[Delivery, str]]:
        taken, self.letters = self.letters, []
        return taken
