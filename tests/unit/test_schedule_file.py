"""The run directory's schedule record (`services.common.schedule_file`): written from the
store's streams, read back whole, refused when cut short or tampered with."""

from __future__ import annotations

import gzip
import logging
from pathlib import Path

import pytest

from broker.memory_store import InMemoryWeightStore
from services.common.schedule import (
    AGGREGATOR_STREAM,
    COORDINATOR_STREAM,
    Applied,
    Folded,
    FoldedUpdate,
    Header,
    MemberEvent,
    ScheduleLog,
    shard_stream,
)
from services.common.schedule_file import (
    SCHEDULE_FILE,
    ScheduleFileError,
    keep_schedule,
    read_schedule_file,
    write_schedule,
)

JOB = "sched"
HEADER = Header(JOB, seed=7, deterministic=True, mode="sync", torch_threads=2)


def _recorded(store: InMemoryWeightStore) -> dict[str, list[object]]:
    shard = ScheduleLog(store, JOB, shard_stream(0))
    aggregator = ScheduleLog(store, JOB, AGGREGATOR_STREAM)
    coordinator = ScheduleLog(store, JOB, COORDINATOR_STREAM)
    joined = [MemberEvent("join", f"c{i}", 0, partition=i, shard=0) for i in range(2)]
    applied = [Applied(0, f"c{i % 2}", 0, i // 2, 1, i + 1, i // 2) for i in range(4)]
    update = FoldedUpdate("c0", 1, 0, 1.0, samples=32.0)
    folded = [Folded(2, 0, (update,), ((0, 4),), "ab" * 16)]
    for log, entries in ((coordinator, joined), (shard, applied), (aggregator, folded)):
        for entry in entries:
            log.add(entry)
        log.flush()
    return {"aggregator": list(folded), "coordinator": list(joined), "shard-0": list(applied)}


def test_round_trip(tmp_path: Path) -> None:
    store = InMemoryWeightStore()
    expected = _recorded(store)
    path = write_schedule(tmp_path, store, JOB, HEADER)
    assert path == tmp_path / SCHEDULE_FILE
    schedule = read_schedule_file(path)
    assert schedule.header.streams == ("aggregator", "coordinator", "shard-0")
    assert schedule.header.seed == 7 and schedule.header.mode == "sync"
    assert {name: list(entries) for name, entries in schedule.streams.items()} == expected
    assert schedule.entries == 7
    # Same record, same bytes (no time in the gzip header): a record can be compared by hash.
    first = path.read_bytes()
    assert write_schedule(tmp_path, store, JOB, HEADER).read_bytes() == first
    assert not list(tmp_path.glob("*.partial"))


def test_an_empty_record_is_a_header_and_an_end(tmp_path: Path) -> None:
    schedule = read_schedule_file(write_schedule(tmp_path, InMemoryWeightStore(), JOB, HEADER))
    assert schedule.streams == {} and schedule.header.streams == ()


def _lines(path: Path) -> list[str]:
    with gzip.open(path, "rt") as f:
        return f.read().splitlines()


def _rewrite(path: Path, lines: list[str]) -> None:
    with gzip.open(path, "wt") as f:
        f.write("".join(line + "\n" for line in lines))


def test_a_truncated_file_is_refused(tmp_path: Path) -> None:
    store = InMemoryWeightStore()
    _recorded(store)
    path = write_schedule(tmp_path, store, JOB, HEADER)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])  # a copy cut short: the gzip stream ends early
    with pytest.raises(ScheduleFileError, match="gzip"):
        read_schedule_file(path)


@pytest.mark.parametrize(
    ("cut", "why"),
    [
        (lambda ls: ls[:-1], "no end line"),  # the writer stopped before the end
        (lambda ls: ls[:-3], "cut short|no end line"),  # inside the last stream
        (lambda ls: [ls[1], *ls[2:]], "header"),  # no header first
        (lambda ls: [*ls[:3], "{not json", *ls[3:]], "not JSON|expected a stream"),
        (lambda ls: [*ls, ls[-1]], "after the end"),
        (lambda ls: [ls[0], *ls[2:]], "stream line"),  # a stream's marker lost
    ],
)
def test_a_damaged_record_is_refused(tmp_path: Path, cut: object, why: str) -> None:
    store = InMemoryWeightStore()
    _recorded(store)
    path = write_schedule(tmp_path, store, JOB, HEADER)
    _rewrite(path, cut(_lines(path)))  # type: ignore[operator]
    with pytest.raises(ScheduleFileError, match=why):
        read_schedule_file(path)


def test_not_gzip_and_missing_are_refused(tmp_path: Path) -> None:
    bad = tmp_path / SCHEDULE_FILE
    bad.write_text("{}")
    with pytest.raises(ScheduleFileError, match="gzip"):
        read_schedule_file(bad)
    with pytest.raises(ScheduleFileError):
        read_schedule_file(tmp_path / "missing.gz")


def test_keep_schedule_logs_one_line(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    store = InMemoryWeightStore()
    _recorded(store)
    with caplog.at_level(logging.INFO):
        path = keep_schedule(tmp_path, store, JOB, HEADER, logging.getLogger("t"))
    assert path is not None
    assert [r.getMessage() for r in caplog.records] == [f"schedule record: 7 entries in {path}"]
    assert keep_schedule(tmp_path / "gone", store, JOB, HEADER, logging.getLogger("t")) is None
