"""`BrokerMeter`: what a broker handle reports (`broker.transport.Meter`), told to a recorder.

Given to the handle a role opens (`Backends.open_broker`), it measures every role alike without
a line in their code: bytes of each publish and delivery, the time spent blocked in `get` (the
busy fraction is the rest), and each dead letter by its reason code.
"""

from __future__ import annotations

from services.metrics.recorder import Metrics, reason_code

# A delivery rejected without a reason goes to the dead-letter queue by the queue's own routing.
NACK_REASON = "nack"


class BrokerMeter:
    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics

    def sent(self, routing_key: str, nbytes: int, seconds: float) -> None:
        self._metrics.bytes_out(nbytes)

    def received(self, nbytes: int, waited_s: float) -> None:
        self._metrics.waited(waited_s)
        if nbytes:
            self._metrics.bytes_in(nbytes)

    def dead_lettered(self, reason: str | None) -> None:
        self._metrics.dead_lettered(NACK_REASON if reason is None else reason_code(reason))
