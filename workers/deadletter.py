"""Rejecting a delivery with its reason, without ever letting the rejection itself crash us."""

from __future__ import annotations

import logging

from broker.rejection import Rejected, dead_letter_safely
from broker.transport import Broker, Delivery
from workers.stats import WorkerStats


def reject(
    broker: Broker,
    delivery: Delivery,
    code: str,
    detail: str,
    stats: WorkerStats,
    logger: logging.Logger,
) -> None:
    """Dead-letter `delivery` with reason `"<code>: <detail>"` and count it under `code`."""
    reason = f"{code}: {detail}"
    # A full dead-letter queue: RabbitMQ's own dead-lettering still moves it there (or drops
    # it), without our reason header; a poison message is never requeued.
    if dead_letter_safely(broker, delivery, reason) is Rejected.REDELIVERED:
        # Its connection is gone: it will be redelivered and rejected again then.
        logger.info("dead-letter of a stale delivery from %s skipped (%s)", delivery.queue, reason)
        return
    stats.dead_lettered[code] += 1
    logger.warning("dead-lettered a message from %s: %s", delivery.queue, reason)
