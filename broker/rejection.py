"""Rejecting a delivery, so that neither the rejection nor its settlement can crash a consumer.

Every consumer that meets bad input goes through `dead_letter_safely` and `ack_safely`: a
connection lost between `get` and the settlement makes the broker redeliver the message (it is
judged again then), and a full dead-letter queue falls back to the queue's own dead-letter
routing, without the reason header but never requeued (a poison message must not loop).
"""

from __future__ import annotations

import enum

from broker.errors import BackPressureError, StaleDeliveryError
from broker.transport import Broker, Delivery


class Rejected(enum.Enum):
    DEAD_LETTERED = "dead-lettered"  # in the dead-letter queue with its reason
    WITHOUT_REASON = "without reason"  # the dead-letter queue was full: nacked, no header
    REDELIVERED = "redelivered"  # its connection was gone: it comes back and is judged again


def dead_letter_safely(broker: Broker, delivery: Delivery, reason: str) -> Rejected:
    """Dead-letter `delivery` with `reason`; says what became of it."""
    try:
        broker.dead_letter(delivery, reason)
    except StaleDeliveryError:
        return Rejected.REDELIVERED
    except BackPressureError:
        try:
            broker.nack(delivery, requeue=False)
        except StaleDeliveryError:
            return Rejected.REDELIVERED
        return Rejected.WITHOUT_REASON
    return Rejected.DEAD_LETTERED


def ack_safely(broker: Broker, delivery: Delivery) -> bool:
    """Ack; False when the delivery's connection is gone (the broker redelivers it)."""
    try:
        broker.ack(delivery)
    except StaleDeliveryError:
        return False
    return True
