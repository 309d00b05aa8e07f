"""Availability traces: when each client is online, read from and written to CSV (docs/traces.md).

A trace is a set of online intervals per client, in seconds from the start of the run,
half-open: a client is online at `t` when `from <= t < to` for one of its intervals. A row
names its client by a 0-based index (an integer: the host's n-th client, so one trace fits
any host) or by a client id (anything else); when a client has rows under both, its id's rows
win, being the more specific. A client with no rows follows the trace's `missing` rule.

Pure: no broker, no torch; the client host replays each client's `intervals`.
"""

from __future__ import annotations

import bisect
import csv
import io
import itertools
import math
import re
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from services.data.errors import DataFormatError

COLUMNS = ("client", "online_from_s", "online_to_s")

Interval = tuple[float, float]
ClientKey = int | str
Missing = Literal["online", "offline"]

# Ids go into queue names and Redis keys: the job-name alphabet, which CSV never quotes.
_CLIENT_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]{0,127}")
_INDEX = re.compile(r"[0-9]+")
_ALWAYS: tuple[Interval, ...] = ((0.0, math.inf),)


class TraceError(DataFormatError):
    """A trace file that does not parse; the message is `file:line: what is wrong`."""


@dataclass(frozen=True)
class TraceStats:
    """What a report says about a trace: counts, session lengths, online fraction over time."""

    clients: int
    sessions: int
    sessions_per_client: float
    mean_session_s: float  # over finite sessions; nan when there are none
    median_session_s: float
    bucket_s: float
    online_fraction: tuple[float, ...]  # time-averaged fraction of the trace's clients, per bucket


@dataclass(frozen=True)
class Trace:
    """Online intervals per client (sorted, disjoint), and the rule for clients not in it."""

    sessions: Mapping[ClientKey, tuple[Interval, ...]]
    missing: Missing = "online"

    # -- reading and writing ------------------------------------------------------------------

    @classmethod
    def load(cls, path: Path | str, missing: Missing = "online") -> Trace:
        path = Path(path)
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as exc:
            raise TraceError(path, f"cannot read the trace: {exc.strerror or exc}") from None
        return cls.parse(text, source=str(path), missing=missing)

    @classmethod
    def parse(cls, text: str, source: str = "<trace>", missing: Missing = "online") -> Trace:
        rows = csv.reader(io.StringIO(text))
        order = _header(source, next(rows, None))
        spans: dict[ClientKey, list[tuple[float, float, int]]] = {}
        for cells in rows:
            line = rows.line_num
            if not any(cell.strip() for cell in cells):
                continue
            if len(cells) != len(order):
                raise TraceError(f"{source}:{line}", f"{len(cells)} fields, the header has 3")
            row = dict(zip(order, (cell.strip() for cell in cells), strict=True))
            key = _client(source, line, row["client"])
            start, end = _interval(source, line, row["online_from_s"], row["online_to_s"])
            spans.setdefault(key, []).append((start, end, line))
        return cls(_disjoint(source, spans), missing)

    def to_csv(self) -> str:
        out = io.StringIO()
        writer = csv.writer(out, lineterminator="\n")
        writer.writerow(COLUMNS)
        for key in self.clients():
            for start, end in self.sessions[key]:
                writer.writerow((key, _number(start), _number(end)))
        return out.getvalue()

    def save(self, path: Path | str) -> None:
        Path(path).write_text(self.to_csv(), encoding="utf-8")

    # -- what the client host asks ------------------------------------------------------------

    def intervals(self, index: int, client_id: str | None = None) -> tuple[Interval, ...]:
        """The online intervals of the host's `index`-th client, whose id is `client_id`."""
        found = self._key(index, client_id)
        if found is not None:
            return self.sessions[found]
        return _ALWAYS if self.missing == "online" else ()

    def online(self, index: int, client_id: str | None, t: float) -> bool:
        spans, at = self._find(index, client_id, t)
        return at >= 0 and t < spans[at][1]

    def next_change(self, index: int, client_id: str | None, t: float) -> float:
        """The first time after `t` at which the client goes on- or offline (inf: never)."""
        spans, at = self._find(index, client_id, t)
        if at >= 0 and t < spans[at][1]:
            return spans[at][1]
        return spans[at + 1][0] if at + 1 < len(spans) else math.inf

    # -- transforms and stats -----------------------------------------------------------------

    def scaled(self, factor: float) -> Trace:
        """Every time multiplied by `factor` (86400 s replayed in 300 s: factor 300 / 86400)."""
        if not (math.isfinite(factor) and factor > 0):
            raise ValueError(f"a trace's time scale must be a positive number, not {factor!r}")
        sessions = {
            key: tuple((start * factor, end * factor) for start, end in spans)
            for key, spans in self.sessions.items()
        }
        return Trace(sessions, self.missing)

    def clients(self) -> list[ClientKey]:
        """The trace's own clients: indices in order, then ids in order."""
        return sorted(self.sessions, key=lambda key: (isinstance(key, str), key))

    def end_s(self) -> float:
        """The last finite time the trace names (0 for an empty trace)."""
        times = (t for spans in self.sessions.values() for span in spans for t in span)
        return max((t for t in times if math.isfinite(t)), default=0.0)

    def online_fraction(self, start: float, end: float) -> float:
        """Time-averaged fraction of the trace's clients online over [start, end)."""
        if not self.sessions or end <= start:
            return math.nan
        covered = sum(
            max(0.0, min(to, end) - max(since, start))
            for spans in self.sessions.values()
            for since, to in spans
        )
        return covered / ((end - start) * len(self.sessions))

    def stats(self, buckets: int = 24, end_s: float | None = None) -> TraceStats:
        end = self.end_s() if end_s is None else end_s
        lengths = [to - since for spans in self.sessions.values() for since, to in spans]
        finite = [length for length in lengths if math.isfinite(length)]
        bucket_s = end / buckets if buckets > 0 and end > 0 else 0.0
        fractions = tuple(
            self.online_fraction(i * bucket_s, (i + 1) * bucket_s)
            for i in range(buckets if bucket_s else 0)
        )
        return TraceStats(
            clients=len(self.sessions),
            sessions=len(lengths),
            sessions_per_client=len(lengths) / len(self.sessions) if self.sessions else 0.0,
            mean_session_s=statistics.fmean(finite) if finite else math.nan,
            median_session_s=statistics.median(finite) if finite else math.nan,
            bucket_s=bucket_s,
            online_fraction=fractions,
        )

    def _key(self, index: int, client_id: str | None) -> ClientKey | None:
        if client_id is not None and client_id in self.sessions:
            return client_id
        return index if index in self.sessions else None

    def _find(self, index: int, client_id: str | None, t: float) -> tuple[Sequence[Interval], int]:
        """The client's intervals and the position of the last one starting at or before `t`."""
        spans = self.intervals(index, client_id)
        # (t, inf) sorts after every interval starting at or before t.
        return spans, bisect.bisect_right(spans, (t, math.inf)) - 1


def _header(source: str, header: Sequence[str] | None) -> list[str]:
    """The column names, in their order (a `TraceError` unless they are `COLUMNS`)."""
    if header is None:
        raise TraceError(f"{source}:1", f"empty file: the header {','.join(COLUMNS)} is missing")
    names = [name.strip() for name in header]
    unknown = [name for name in names if name not in COLUMNS]
    if unknown:
        raise TraceError(
            f"{source}:1", f"unknown column {unknown[0]!r}: the columns are {', '.join(COLUMNS)}"
        )
    absent = [name for name in COLUMNS if name not in names]
    if absent:
        raise TraceError(f"{source}:1", f"missing column {absent[0]!r}")
    if len(names) != len(COLUMNS):
        raise TraceError(f"{source}:1", "a column is named twice")
    return names


def _client(source: str, line: int, cell: str) -> ClientKey:
    if _INDEX.fullmatch(cell):
        return int(cell)
    if not _CLIENT_ID.fullmatch(cell):
        raise TraceError(
            f"{source}:{line}",
            f"bad client {cell!r}: a 0-based index or an id of 1-128 characters of "
            "[A-Za-z0-9_.-] starting with a letter or digit",
        )
    return cell


def _interval(source: str, line: int, since: str, to: str) -> Interval:
    start = _time(source, line, "online_from_s", since)
    end = _time(source, line, "online_to_s", to)
    if math.isinf(start):
        raise TraceError(f"{source}:{line}", "online_from_s is inf: only online_to_s may be")
    if start >= end:
        raise TraceError(
            f"{source}:{line}", f"online_from_s {since} is not before online_to_s {to}"
        )
    return start, end


def _time(source: str, line: int, column: str, cell: str) -> float:
    try:
        value = float(cell)
    except ValueError:
        raise TraceError(f"{source}:{line}", f"{column} {cell!r} is not a number") from None
    if math.isnan(value):
        raise TraceError(f"{source}:{line}", f"{column} is nan")
    if value < 0:
        raise TraceError(f"{source}:{line}", f"{column} {cell} is negative")
    return value


def _disjoint(
    source: str, spans: Mapping[ClientKey, Iterable[tuple[float, float, int]]]
) -> dict[ClientKey, tuple[Interval, ...]]:
    result: dict[ClientKey, tuple[Interval, ...]] = {}
    for key, rows in spans.items():
        ordered = sorted(rows)
        for (_, end, first), (start, _, line) in itertools.pairwise(ordered):
            if start < end:
                raise TraceError(
                    f"{source}:{line}",
                    f"client {key!r}: this interval overlaps the one on line {first}",
                )
        result[key] = tuple((start, end) for start, end, _ in ordered)
    return result


def _number(value: float) -> str:
    return "inf" if math.isinf(value) else repr(value)
