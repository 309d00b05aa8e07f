"""The canonical order of a sync round's batches (workers/sequencer.py, issue 36)."""

from __future__ import annotations

import itertools

from workers.sequencer import Sequencer

COHORT = {"c": 10, "a": 20, "b": 30}  # cohort order is the RoundStart's, not alphabetical
STEPS = 3
CANONICAL = [f"{c}{s}" for s in range(STEPS) for c in COHORT]  # round-robin, cohort order
TIMEOUT = 30.0


def run(arrivals: list[tuple[str, int]], *, steps: dict[str, int] | None = None) -> list[str]:
    """Feed (client, step) arrivals, taking after each; what was released, in order."""
    seq: Sequencer[str] = Sequencer(TIMEOUT)
    out: list[str] = []
    for client, step in arrivals:
        n = (steps or {}).get(client, STEPS)
        out += seq.offer(client, step, n, f"{client}{step}", True, COHORT, {}, 0.0)  # add, take
    out += seq.settle(COHORT, {})
    return out


def plausible(order: tuple[tuple[str, int], ...]) -> bool:
    """Each client sends its steps in order (it waits for the previous reply)."""
    seen: dict[str, int] = {}
    for client, step in order:
        if seen.get(client, -1) != step - 1:
            return False
        seen[client] = step
    return True


def test_every_arrival_order_gives_the_canonical_order() -> None:
    batches = [(c, s) for c in COHORT for s in range(2)]
    orders = [o for o in itertools.permutations(batches) if plausible(o)]
    assert len(orders) > 50
    expected = [f"{c}{s}" for s in range(2) for c in COHORT]
    for order in orders:
        assert run(list(order)) == expected, order


def test_releases_as_soon_as_the_turn_has_come() -> None:
    seq: Sequencer[str] = Sequencer(TIMEOUT)
    seq.add("a", 0, STEPS, "a0", ordered=True)
    assert seq.take(COHORT, {}, 0.0) == []  # c's step 0 comes first
    assert seq.due_at == TIMEOUT  # a waits for c
    seq.add("c", 0, STEPS, "c0", ordered=True)
    assert seq.take(COHORT, {}, 1.0) == ["c0", "a0"]
    assert seq.due_at is None  # nobody waits
    assert len(seq) == 0


def test_a_finished_client_leaves_the_rotation() -> None:
    # c has one step this round: after it, a and b alternate without waiting for it.
    arrivals = [("a", 0), ("c", 0), ("b", 0), ("b", 1), ("a", 1), ("a", 2), ("b", 2)]
    assert run(arrivals, steps={"c": 1}) == ["c0", "a0", "b0", "a1", "b1", "a2", "b2"]


def test_the_replicas_progress_counts_as_served() -> None:
    # A successor restored from a checkpoint in which c and a had served step 0.
    seq: Sequencer[str] = Sequencer(TIMEOUT)
    progress = {"c": (0, STEPS), "a": (0, STEPS)}
    seq.add("c", 1, STEPS, "c1", ordered=True)
    assert seq.take(COHORT, progress, 0.0) == []  # b's step 0 is due first
    seq.add("b", 0, STEPS, "b0", ordered=True)
    assert seq.take(COHORT, progress, 0.0) == ["b0", "c1"]
    progress = {"c": (1, 2), "a": (0, STEPS)}  # c finished
    seq.add("b", 1, STEPS, "b1", ordered=True)
    assert seq.take(COHORT, progress, 0.0) == []  # a's step 1 first
    assert seq.take({"b": 1}, progress, 0.0) == ["b1"]


def test_a_silent_client_is_skipped_after_the_timeout() -> None:
    seq: Sequencer[str] = Sequencer(TIMEOUT)
    seq.add("a", 0, STEPS, "a0", ordered=True)
    seq.add("b", 0, STEPS, "b0", ordered=True)
    assert seq.take(COHORT, {}, 5.0) == []
    assert seq.take(COHORT, {}, 5.0 + TIMEOUT - 0.1) == []
    assert seq.take(COHORT, {}, 5.0 + TIMEOUT) == ["a0", "b0"]
    assert seq.skipped == {"c"}
    # For the rest of the round the others go on without it; its late batch follows theirs.
    seq.add("c", 0, STEPS, "c0", ordered=True)
    seq.add("a", 1, STEPS, "a1", ordered=True)
    assert seq.take(COHORT, {}, 40.0) == ["a1", "c0"]
    seq.new_round()
    assert seq.skipped == set()


def test_settle_gives_everything_in_canonical_order() -> None:
    seq: Sequencer[str] = Sequencer(TIMEOUT)
    for client, step in [("b", 1), ("a", 0), ("b", 0), ("a", 1)]:
        seq.add(client, step, STEPS, f"{client}{step}", ordered=True)
    seq.add("x", 0, STEPS, "x0", ordered=False)
    assert seq.take(COHORT, {}, 0.0) == []  # c's step 0 first
    assert seq.settle(COHORT, {}) == ["a0", "b0", "a1", "b1", "x0"]
    assert len(seq) == 0 and seq.due_at is None


def test_batches_outside_the_cohort_go_after() -> None:
    seq: Sequencer[str] = Sequencer(TIMEOUT)
    seq.add("x", 0, STEPS, "x0", ordered=False)
    assert seq.take(COHORT, {}, 0.0) == []  # c is expected: x waits for the next release
    seq.add("c", 0, STEPS, "c0", ordered=True)
    assert seq.take(COHORT, {}, 0.0) == ["c0", "x0"]
    # Nobody expected (no cohort yet, or all finished): at once.
    seq.add("y", 0, STEPS, "y0", ordered=False)
    assert seq.take({}, {}, 0.0) == ["y0"]


def test_replace_and_clear() -> None:
    seq: Sequencer[str] = Sequencer(TIMEOUT)
    seq.add("a", 0, STEPS, "a0", ordered=True)
    seq.add("x", 0, STEPS, "x0", ordered=False)
    assert seq.replace(lambda i: i == "a0", lambda i: i + "'") == "a0"
    assert seq.replace(lambda i: i == "x0", lambda i: i + "'") == "x0"
    assert seq.replace(lambda i: i == "zz", lambda i: i) is None
    assert seq.settle(COHORT, {}) == ["a0'", "x0'"]
    seq.add("a", 1, STEPS, "a1", ordered=True)
    assert seq.take(COHORT, {}, 0.0) == []
    seq.clear()
    assert len(seq) == 0 and seq.due_at is None


def test_holding_its_limit_it_stops_waiting_at_once() -> None:
    # The worker's prefetch is full of waiting batches: the turn's may never reach it.
    seq: Sequencer[str] = Sequencer(TIMEOUT, limit=2)
    seq.add("a", 0, STEPS, "a0", ordered=True)
    assert seq.take(COHORT, {}, 0.0) == []
    seq.add("a", 1, STEPS, "a1", ordered=True)
    assert seq.take(COHORT, {}, 0.0) == ["a0"]  # c skipped; below its limit, b is waited for
    assert seq.skipped == {"c"}
