"""A replay's record held against its run's: the first place they part (issue 36).

What must agree, per shard: the batches the replica's state is made of, in order (client,
round, step), and the weights' digest at every position both checkpointed; per version: the
digest of the published weights. A shard's effective history is its Applied entries with the
ones a take-over lost cut away (`Restored` at position n keeps the first n). Membership events
and the workers' names are not compared: they say who did the work, not what it computed.
"""

from __future__ import annotations

from collections.abc import Sequence

# The effective history lives beside the entries: a replay's worker serves it (issue 36).
from services.common.schedule import AGGREGATOR_STREAM, BatchKey, Folded, shard_history
from services.common.schedule_file import Schedule


def folds(schedule: Schedule) -> dict[int, Folded]:
    """The record's Folded entries by version (a repeated one, after a store retry: the last)."""
    return {
        e.version: e for e in schedule.streams.get(AGGREGATOR_STREAM, ()) if isinstance(e, Folded)
    }


def last_version(schedule: Schedule) -> int:
    return max(folds(schedule), default=1)


def shard_names(schedule: Schedule) -> list[str]:
    return sorted(s for s in schedule.streams if s.startswith("shard-"))


def first_divergence(recorded: Schedule, replayed: Schedule, *, up_to: int) -> str | None:
    """Where `replayed` first differs from `recorded` for the versions up to `up_to`; None when
    it reproduces every recorded batch order, checkpoint and version."""
    rec_folds, rep_folds = folds(recorded), folds(replayed)
    for version in sorted(v for v in rec_folds if v <= up_to):
        got = rep_folds.get(version)
        if got is None:
            return f"version {version}: recorded, never published by the replay"
        want = rec_folds[version]
        if got.digest != want.digest:
            why = _shards_part(recorded, replayed, version - 1) or "its fold differs"
            return f"version {version}: weights differ from the record ({why})"
    return _shards_part(recorded, replayed, up_to - 1)


def _shards_part(recorded: Schedule, replayed: Schedule, rounds: int) -> str | None:
    """The shards' first difference within the first `rounds` rounds (those whose versions
    are compared; sync rounds follow one another on a shard, so they are a prefix of it)."""
    for name in sorted(set(shard_names(recorded)) | set(shard_names(replayed))):
        want = shard_history(recorded.streams.get(name, ()))
        got = shard_history(replayed.streams.get(name, ()))
        want_batches = [k for k in want.batches if k[1] < rounds]
        got_batches = [k for k in got.batches if k[1] < rounds]
        where = _first_difference(want_batches, got_batches)
        if where is not None:
            return f"{name}: {where}"
        shared = set(want.digests) & set(got.digests)
        for position in sorted(p for p in shared if p <= len(want_batches)):
            if want.digests[position] != got.digests[position]:
                return f"{name}: weights differ at the checkpoint after batch {position}"
    return None


def _first_difference(want: Sequence[BatchKey], got: Sequence[BatchKey]) -> str | None:
    for i, (a, b) in enumerate(zip(want, got, strict=False)):
        if a != b:
            return f"batch {i + 1} is {_key(b)} in the replay, {_key(a)} in the record"
    if len(want) != len(got):
        return f"{len(got)} batches applied in the replay, {len(want)} in the record"
    return None


def _key(k: BatchKey) -> str:
    client, round_index, step = k
    return f"{client} round {round_index + 1} step {step}"
