"""`first_divergence`: the first place a replay's record parts from its run's."""

from __future__ import annotations

from collections.abc import Sequence

from services.common.schedule import (
    AGGREGATOR_STREAM,
    Applied,
    Checkpointed,
    Entry,
    Folded,
    Header,
    Restored,
    shard_history,
    shard_stream,
)
from services.common.schedule_compare import first_divergence, last_version
from services.common.schedule_file import Schedule

HEADER = Header(job="j", seed=0, deterministic=True, mode="sync", torch_threads=1)


def applied(order: Sequence[tuple[str, int, int]], start: int = 0) -> list[Entry]:
    return [
        Applied(0, c, r, s, version=r + 1, position=start + i + 1, step_no=start + i + 1)
        for i, (c, r, s) in enumerate(order)
    ]


def record(shard: Sequence[Entry], digests: dict[int, str]) -> Schedule:
    folded = [Folded(v, v - 2, (), ((0, 0),), d) for v, d in sorted(digests.items())]
    return Schedule(HEADER, {AGGREGATOR_STREAM: tuple(folded), shard_stream(0): tuple(shard)})


ORDER = [("a", 0, 0), ("b", 0, 0), ("a", 0, 1), ("b", 0, 1), ("a", 1, 0), ("b", 1, 0)]


def test_an_equal_record_is_reproduced() -> None:
    run = record([*applied(ORDER), Checkpointed(0, 4, 1, "x")], {2: "v2", 3: "v3"})
    assert first_divergence(run, run, up_to=3) is None
    assert last_version(run) == 3


def test_a_moved_batch_is_named_where_it_moved() -> None:
    moved = [ORDER[0], ORDER[2], ORDER[1], *ORDER[3:]]
    run, replay = record(applied(moved), {2: "v2"}), record(applied(ORDER), {2: "v2"})
    where = first_divergence(run, replay, up_to=2)
    assert (
        where
        == "shard-0: batch 2 is b round 1 step 0 in the replay, a round 1 step 1 in the record"
    )


def test_other_weights_at_a_version_are_found_first() -> None:
    run, replay = record(applied(ORDER), {2: "v2"}), record(applied(ORDER), {2: "other"})
    assert first_divergence(run, replay, up_to=2) == (
        "version 2: weights differ from the record (its fold differs)"
    )


def test_a_checkpoint_digest_that_differs_is_found() -> None:
    run = record([*applied(ORDER[:4]), Checkpointed(0, 4, 1, "x")], {})
    replay = record([*applied(ORDER[:4]), Checkpointed(0, 4, 1, "y")], {})
    assert first_divergence(run, replay, up_to=2) == (
        "shard-0: weights differ at the checkpoint after batch 4"
    )


def test_only_the_rounds_of_the_compared_versions_count() -> None:
    # The record ends at version 2 (round 1): the run's round-2 batches are not compared.
    run, replay = record(applied(ORDER), {2: "v2"}), record(applied(ORDER[:4]), {2: "v2"})
    assert first_divergence(run, replay, up_to=2) is None
    assert first_divergence(run, replay, up_to=3) == (
        "shard-0: 4 batches applied in the replay, 6 in the record"
    )
    longer = record(applied(ORDER), {2: "v2", 3: "v3"})
    assert first_divergence(longer, replay, up_to=3) == (
        "version 3: recorded, never published by the replay"
    )


def test_a_take_over_cuts_what_the_lost_holder_applied() -> None:
    # Holder 1 applied 4 and checkpointed at 2; holder 2 restored 2 and applied 3..4 again.
    entries = [
        *applied(ORDER[:2]),
        Checkpointed(0, 2, 1, "c2"),
        *applied(ORDER[2:4], start=2),
        Restored(0, 2, 1, "worker-1"),
        *applied([ORDER[3], ORDER[2]], start=2),
    ]
    history = shard_history(entries)
    assert history.batches == (ORDER[0], ORDER[1], ORDER[3], ORDER[2])
    assert history.restores == 1 and history.digests == {2: "c2"}
