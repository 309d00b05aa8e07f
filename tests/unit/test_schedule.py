"""The schedule entries' wire form (`services.common.schedule`): every type round-trips."""

from __future__ import annotations

import pytest

from services.common.schedule import (
    Applied,
    Checkpointed,
    Entry,
    Folded,
    FoldedUpdate,
    Header,
    MemberEvent,
    Restored,
    ScheduleError,
    decode,
    encode,
)

ENTRIES: list[Entry] = [
    Applied(1, "c0", 2, 3, 4, 5, 6, "w"),
    Checkpointed(1, 5, 4, "ab", "w"),
    Restored(1, 5, 4, "w2"),
    Folded(3, 1, (FoldedUpdate("c0", 2, 0, 1.0, 32.0),), ((0, 5), (1, 7)), "cd"),
    # Its `kind` field must not be taken for the entry's type.
    MemberEvent("join", "c0", 0, partition=1, shard=0),
    MemberEvent("dropped_round", "c1", 3),
    Header("j", 0, True, "async", 4, streams=("aggregator", "shard-0")),
]


@pytest.mark.parametrize("entry", ENTRIES, ids=lambda e: type(e).__name__)
def test_every_entry_round_trips(entry: Entry) -> None:
    assert decode(encode(entry)) == entry


@pytest.mark.parametrize(
    "line", ["{", "[]", '{"kind":"member"}', '{"entry":"nope"}', '{"entry":"restored","x":1}']
)
def test_bad_lines_are_refused(line: str) -> None:
    with pytest.raises(ScheduleError):
        decode(line)
