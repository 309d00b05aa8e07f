"""Small MetricsSinks that compose: print a progress line, fan out to several sinks."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

from services.report.records import MetricsSink, VersionRecord
from services.report.summary import progress_line


class EchoSink:
    """Prints one progress line per published version, and the job's end once."""

    def __init__(self, echo: Callable[[str], None], rounds: int = 0) -> None:
        self._echo = echo
        self._rounds = rounds
        self._finished = False

    def record(self, record: VersionRecord) -> None:
        self._echo(progress_line(record, self._rounds))

    def finish(self, status: str) -> None:
        # The aggregator reports its own end, then the runner reports the run's: say it once.
        if not self._finished:
            self._finished = True
            self._echo(f"job {status}")


class TeeSink:
    """Hands every record and the finish to each sink, in order."""

    def __init__(self, sinks: Sequence[MetricsSink]) -> None:
        self._sinks = tuple(sinks)

    def record(self, record: VersionRecord) -> None:
        for sink in self._sinks:
            sink.record(record)

    def finish(self, status: str) -> None:
        for sink in self._sinks:
            sink.finish(status)


class RecordsOnly:
    """Forwards records but not `finish`: for a sink whose owner, not the role, ends the run.

    In an embedded run the aggregator sees only its own side (it was stopped), while the
    runner knows why (a worker died); the runner's status is the one worth keeping.
    """

    def __init__(self, sink: MetricsSink) -> None:
        self._sink = sink

    def record(self, record: VersionRecord) -> None:
        self._sink.record(record)

    def finish(self, status: str) -> None:
        pass


class Continued:
    """Moves every record's `elapsed_s` on by `before_s`: a resumed run's clock starts at 0,
    its report's time axis goes on from where the stopped run's ended."""

    def __init__(self, sink: MetricsSink, before_s: float) -> None:
        self._sink = sink
        self._before_s = before_s

    def record(self, record: VersionRecord) -> None:
        self._sink.record(replace(record, elapsed_s=record.elapsed_s + self._before_s))

    def finish(self, status: str) -> None:
        self._sink.finish(status)
