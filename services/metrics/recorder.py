"""The `Metrics` roles report through, a no-op unless a process's meters record it.

A recorder is bound to one role (and member: a worker id) of one job; a process makes them
from its `Meters` (one per process, holding the registry). Role code calls these methods at a
few points and never imports Prometheus, so tests and metric-less runs pay nothing.
"""

from __future__ import annotations

import re

from services.report.records import VersionRecord


class Metrics:
    """What one role reports. Every method is cheap and never raises; this base records
    nothing (`NO_METRICS`), and the Prometheus recorders override what they record."""

    # False for the no-op: callers may skip work whose only use is a measurement.
    enabled = False

    def samples(self, n: int) -> None:
        """`n` more training samples processed (samples/s is the rate of their total)."""

    def step(self, seconds: float) -> None:
        """One server step took `seconds` (forward, backward, optimizer step, replies)."""

    def staleness(self, lag: int) -> None:
        """A smashed batch or update arrived `lag` versions behind the receiver's version."""

    def dead_lettered(self, reason: str) -> None:
        """One message dead-lettered with `reason` (a short code, see `reason_code`)."""

    def bytes_in(self, n: int) -> None:
        """`n` message bytes received."""

    def bytes_out(self, n: int) -> None:
        """`n` message bytes published."""

    def waited(self, seconds: float) -> None:
        """Time spent blocked waiting for work (the busy fraction is the rest)."""

    def queue_depth(self, shard: int, depth: int) -> None:
        """Messages ready in the shard's queue."""

    def version(self, version: int) -> None:
        """The job's current version, as this process last saw it."""

    def members(self, kind: str, count: int) -> None:
        """Live members of a kind ("client", "worker")."""

    def member_info(self) -> dict[str, str]:
        """A few current values for this member's store heartbeat (dashboards read them)."""
        return {}


NO_METRICS = Metrics()


class Meters:
    """A process's source of recorders, one per role it runs; this base hands out
    `NO_METRICS` (`NO_METERS`)."""

    def role(self, kind: str, member: str = "") -> Metrics:
        return NO_METRICS


NO_METERS = Meters()

_CODE = re.compile(r"([a-z][a-z0-9_]{1,31}):")
OTHER_REASON = "rejected"


def reason_code(reason: str) -> str:
    """The label of a dead-letter reason: its leading `code:` when it has one.

    Reasons are `"<code>: <detail>"` (workers, decode errors); details name clients, rounds and
    tensors, so they never become label values: that would grow the series without bound.
    """
    match = _CODE.match(reason)
    return match.group(1) if match else OTHER_REASON


class RecordMetrics:
    """A `MetricsSink` that counts each published version's trained samples and sets the
    version gauge: the aggregator's records as metrics."""

    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics

    def record(self, record: VersionRecord) -> None:
        self._metrics.samples(record.samples)
        self._metrics.version(record.version)

    def finish(self, status: str) -> None:
        pass
