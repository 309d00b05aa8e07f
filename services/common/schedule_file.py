"""The run directory's schedule record, `schedule.jsonl.gz` (issue 36): every stream the roles
appended to the store (`services.common.schedule`), in one gzip file, for `splitmq replay`.

Format (gzip of UTF-8 JSON lines, one object a line, each `schedule.encode`d):

    {"entry":"header","job":...,"seed":...,"deterministic":...,"mode":"sync"|"async",
     "torch_threads":...,"format":1,"streams":["aggregator","coordinator","shard-0",...]}
    {"entry":"stream","name":"aggregator","entries":N}
    ... N entries of that stream, in the order its writer appended them ...
    {"entry":"stream","name":"coordinator","entries":M}
    ... M entries ...
    {"entry":"end","entries":N+M+...}

The header comes first; then each stream of the header's `streams` (sorted by name), as a
stream line with its entry count followed by exactly that many entries, unchanged from the
store (so a reader tells the streams apart without a field per entry, and an entry's bytes
are what its writer wrote); a last `end` line with the total. The stream and end lines are
the file's own (types "stream", "end"), never entries of a stream. A file that does not parse,
whose counts disagree, or that lacks the `end` line (a copy cut short, a writer killed while
writing) is refused by `read_schedule_file` with `ScheduleFileError`, never half read.
"""

from __future__ import annotations

import gzip
import json
import logging
import os
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path

from broker.store import ScheduleStore
from services.common.schedule import ENTRY_KEY, Entry, Header, ScheduleError, decode, encode

SCHEDULE_FILE = "schedule.jsonl.gz"
_STREAM = "stream"
_END = "end"


class ScheduleFileError(ValueError):
    """A schedule file that cannot be read whole; the message names the file and why."""


# Builds the error for a line (0-based index) of the file being read.
_Fail = Callable[[int, str], ScheduleFileError]


@dataclass(frozen=True)
class Schedule:
    """A run's record as read back: its header and each stream's entries, in order."""

    header: Header
    streams: Mapping[str, tuple[Entry, ...]]

    @property
    def entries(self) -> int:
        return sum(len(e) for e in self.streams.values())


def write_schedule(run_dir: Path, store: ScheduleStore, job: str, header: Header) -> Path:
    """Write every stream of `job` in `store` to `run_dir/schedule.jsonl.gz` (replaced whole:
    written to a temporary name, then renamed); its path. The header's `streams` are set to
    the streams found."""
    found = store.read_schedule(job)
    names = sorted(found)
    head = replace(header, streams=tuple(names))
    path = run_dir / SCHEDULE_FILE
    partial = path.with_name(path.name + ".partial")
    total = 0
    # mtime=0: the same record gives the same bytes.
    with open(partial, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as out:
        out.write((encode(head) + "\n").encode())
        for name in names:
            lines = found[name]
            out.write((_marker(_STREAM, name=name, entries=len(lines)) + "\n").encode())
            for line in lines:
                out.write((line + "\n").encode())
            total += len(lines)
        out.write((_marker(_END, entries=total) + "\n").encode())
    os.replace(partial, path)
    return path


def keep_schedule(
    run_dir: Path, store: ScheduleStore, job: str, header: Header, log: logging.Logger
) -> Path | None:
    """`write_schedule`, logged in one line; a failure is logged, not raised (the metrics and
    the model are the run's result, the record is what replays it)."""
    try:
        path = write_schedule(run_dir, store, job, header)
        entries = read_schedule_file(path).entries
    except (OSError, ValueError) as exc:
        log.warning("could not keep the run's schedule record in %s: %s", run_dir, exc)
        return None
    log.info("schedule record: %d entries in %s", entries, path)
    return path


def read_schedule_file(path: Path) -> Schedule:
    """The record in `path`; `ScheduleFileError` when it is not one, or not whole."""
    try:
        with gzip.open(path, "rt", encoding="utf-8") as f:
            lines = f.read().splitlines()
    except (OSError, EOFError, zlib.error, UnicodeDecodeError) as exc:
        raise ScheduleFileError(f"{path}: not a readable gzip file: {exc}") from None
    return _parse(path, lines)


def _parse(path: Path, lines: list[str]) -> Schedule:
    def fail(at: int, why: str) -> ScheduleFileError:
        return ScheduleFileError(f"{path}, line {at + 1}: {why}")

    if not lines:
        raise ScheduleFileError(f"{path}: empty")
    try:
        header = decode(lines[0])
    except ScheduleError as exc:
        raise fail(0, f"the first line is not the header: {exc}") from None
    if not isinstance(header, Header):
        raise fail(0, "the first line is not the header")
    streams: dict[str, tuple[Entry, ...]] = {}
    at = 1
    while at < len(lines):
        marker = _marker_of(lines[at], at, fail)
        kind, count = marker.get(ENTRY_KEY), marker.get("entries")
        if kind not in (_STREAM, _END):
            raise fail(at, f"expected a stream line (or the end line), found {kind!r}")
        if not isinstance(count, int) or count < 0:
            raise fail(at, f"a {kind!r} line without an entry count")
        if kind == _END:
            _check_end(lines, at, count, Schedule(header, streams), fail)
            return Schedule(header, streams)
        name = marker.get("name")
        if not isinstance(name, str) or name in streams:
            raise fail(at, f"a stream line without a name, or a second one of {name!r}")
        body = lines[at + 1 : at + 1 + count]
        if len(body) < count:
            raise fail(len(lines) - 1, f"stream {name!r} cut short ({len(body)} of {count})")
        streams[name] = tuple(_entry(line, at + 1 + i, fail) for i, line in enumerate(body))
        at += 1 + count
    raise ScheduleFileError(f"{path}: no end line: the file was cut short")


def _check_end(lines: list[str], at: int, count: int, found: Schedule, fail: _Fail) -> None:
    """The end line at `at` closes the file and agrees with what was read before it."""
    if at != len(lines) - 1:
        raise fail(at + 1, "lines after the end line")
    if count != found.entries:
        raise fail(at, f"the end line counts {count} entries, the file has {found.entries}")
    if tuple(found.streams) != found.header.streams:
        raise fail(
            at, f"streams {list(found.streams)}, the header says {list(found.header.streams)}"
        )


def _entry(line: str, at: int, fail: _Fail) -> Entry:
    try:
        return decode(line)
    except ScheduleError as exc:
        raise fail(at, str(exc)) from None


def _marker_of(line: str, at: int, fail: _Fail) -> dict[str, object]:
    try:
        raw = json.loads(line)
    except json.JSONDecodeError as exc:
        raise fail(at, f"not JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise fail(at, "not an object")
    return raw


def _marker(kind: str, **fields: object) -> str:
    return json.dumps({ENTRY_KEY: kind, **fields}, separators=(",", ":"))
