"""`RecordMetrics`: the aggregator's per-version records, as samples and the version gauge."""

from __future__ import annotations

from services.metrics.recorder import Metrics
from services.report.records import VersionRecord


class RecordMetrics:
    """A `MetricsSink` that counts each published version's trained samples."""

    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics

    def record(self, record: VersionRecord) -> None:
        self._metrics.samples(record.samples)
        self._metrics.version(record.version)

    def finish(self, status: str) -> None:
        pass
