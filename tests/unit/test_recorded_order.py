"""A replay's order: a shard serves its batches in the order its run recorded, whatever order
they arrive in (workers/sequencer.py `RecordedOrder`, issue 36)."""

from __future__ import annotations

import itertools

from services.common.schedule import Applied, BatchKey, Entry, Restored, shard_history
from workers.sequencer import RecordedOrder

COHORT = {"c": 10, "a": 20, "b": 30}
# A free-running run's order: not the canonical one (round-robin by step in cohort order).
RECORD: list[BatchKey] = [("a", 0, 0), ("a", 0, 1), ("c", 0, 0), ("b", 0, 0), ("b", 0, 1)]
RECORD += [("c", 0, 1)]


def key(item: BatchKey) -> BatchKey:
    return item


def order(record: list[BatchKey], said: list[str] | None = None) -> RecordedOrder[BatchKey]:
    log = said if said is not None else []
    return RecordedOrder(record, key, lambda: 0, 30.0, say=log.append)


def run(arrivals: list[BatchKey], record: list[BatchKey] = RECORD) -> list[BatchKey]:
    seq = order(record)
    out: list[BatchKey] = []
    for k in arrivals:
        out += seq.offer(k[0], k[2], 2, k, True, COHORT, {}, 0.0)
    return out + seq.settle(COHORT, {})


def plausible(arrivals: tuple[BatchKey, ...]) -> bool:
    """Each client sends its steps in order."""
    seen: dict[str, int] = {}
    for client, _, step in arrivals:
        if seen.get(client, -1) != step - 1:
            return False
        seen[client] = step
    return True


def test_every_arrival_order_gives_the_recorded_order() -> None:
    orders = [o for o in itertools.permutations(RECORD) if plausible(o)]
    assert len(orders) > 50
    for arrivals in orders:
        assert run(list(arrivals)) == RECORD, arrivals


def test_releases_as_soon_as_the_turn_has_come_and_never_times_out() -> None:
    seq = order(RECORD)
    assert seq.offer("c", 0, 2, ("c", 0, 0), True, COHORT, {}, 0.0) == []
    assert seq.due_at is None and seq.held == 1  # no timeout: the record says who comes
    assert seq.take(COHORT, {}, 1e9) == []
    assert seq.offer("a", 0, 2, ("a", 0, 0), True, COHORT, {}, 0.0) == [("a", 0, 0)]
    assert seq.offer("a", 1, 2, ("a", 0, 1), True, COHORT, {}, 0.0) == [("a", 0, 1), ("c", 0, 0)]
    assert len(seq) == 0


def test_a_batch_the_run_never_applied_is_refused_never_served() -> None:
    said: list[str] = []
    seq = order(RECORD[:4], said)  # b's step 1 and c's step 1 were never applied
    out: list[BatchKey] = []
    for k in RECORD:
        out += seq.offer(k[0], k[2], 2, k, True, COHORT, {}, 0.0)
    assert out + seq.settle(COHORT, {}) == RECORD[:4]
    # Handed to the runner to answer at once: their clients end the round, as the run's did.
    assert seq.refused == [("b", 0, 1), ("c", 0, 1)] and seq.held == 0
    assert seq.unrecorded == [("b", 0, 1), ("c", 0, 1)]
    assert any("not in the rest of the record" in line for line in said)


def test_rounds_past_the_record_fall_back_to_canonical_order_said_once() -> None:
    said: list[str] = []
    seq = order(RECORD, said)
    out: list[BatchKey] = []
    for k in RECORD:
        out += seq.offer(k[0], k[2], 2, k, True, COHORT, {}, 0.0)
    assert out == RECORD
    seq.new_round()
    later = [("b", 1, 0), ("a", 1, 0), ("c", 1, 0)]  # round 2: the record has none of it
    for k in later:
        out += seq.offer(k[0], k[2], 1, k, True, COHORT, {}, 0.0)
    assert out[len(RECORD) :] == [("c", 1, 0), ("a", 1, 0), ("b", 1, 0)]  # cohort order
    assert sum("past the record" in line for line in said) == 1


def test_a_recorded_turn_that_never_comes_is_given_up_at_the_next_round_settle() -> None:
    said: list[str] = []
    record: list[BatchKey] = [("a", 0, 0), ("b", 0, 0), ("a", 1, 0), ("b", 1, 0)]
    seq = order(record, said)
    out = seq.offer("a", 0, 1, ("a", 0, 0), True, COHORT, {}, 0.0)
    out += seq.settle(COHORT, {})  # round 1 ends without b's batch: it may still come late
    assert out == [("a", 0, 0)]
    out += seq.offer("a", 0, 1, ("a", 1, 0), True, COHORT, {}, 0.0)
    out += seq.offer("b", 0, 1, ("b", 1, 0), True, COHORT, {}, 0.0)
    assert out == [("a", 0, 0)]  # still b's round-1 turn
    out += seq.settle(COHORT, {})  # round 2 ends: b's round-1 batch is given up
    assert out == [("a", 0, 0), ("a", 1, 0), ("b", 1, 0)]
    assert seq.given_up == [("b", 0, 0)]
    assert any("never came" in line for line in said)


def test_a_full_hold_gives_the_turn_up_rather_than_hang() -> None:
    seq = RecordedOrder(RECORD, key, lambda: 0, 30.0, limit=2)
    out = seq.offer("c", 0, 2, ("c", 0, 0), True, COHORT, {}, 0.0)
    out += seq.offer("b", 0, 2, ("b", 0, 0), True, COHORT, {}, 0.0)
    # Two held, the limit: a's batches could not reach the worker; their turns are given up.
    assert out == [("c", 0, 0), ("b", 0, 0)]
    assert seq.given_up == [("a", 0, 0), ("a", 0, 1)]


def test_the_turn_follows_a_take_over_history_and_the_replica_count() -> None:
    def applied(client: str, step: int, position: int) -> Applied:
        return Applied(0, client, 0, step, 1, position, position)

    entries: list[Entry] = [applied(c, s, i + 1) for i, (c, _, s) in enumerate(RECORD[:4])]
    entries.append(Restored(0, 2, 1, "w2"))  # the batches after position 2 were lost
    entries += [applied("b", 0, 3), applied("c", 0, 4)]
    history = shard_history(entries).batches
    assert history == (("a", 0, 0), ("a", 0, 1), ("b", 0, 0), ("c", 0, 0))
    # A replica restored at position 2 (a checkpoint): its turn is the third batch.
    seq = RecordedOrder(history, key, lambda: 2, 30.0)
    assert seq.offer("c", 0, 2, ("c", 0, 0), True, COHORT, {}, 0.0) == []
    assert seq.offer("b", 0, 2, ("b", 0, 0), True, COHORT, {}, 0.0) == [("b", 0, 0), ("c", 0, 0)]
    seq.clear()  # a rollback: the count is read again
    assert seq.held == 0
