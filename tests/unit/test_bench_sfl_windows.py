"""The SFL-V2 benchmark's steady-state windows and in-process variants (pure helpers)."""

from __future__ import annotations

import pytest

from benchmarks.sfl_deploy import Case, windows
from benchmarks.sfl_throughput import variant_threads
from broker.topology import reply_routing_key

JOB = "j"
BIG = 1000


def case(steps: int, rounds: int, warm: int) -> Case:
    return Case(model="cnn5", cut="block1", dataset="d", steps=steps, rounds=rounds, warm=warm)


def replies(starts: list[float], steps: int, every: float = 1.0) -> list[tuple[float, str, int]]:
    """Client i's replies at starts[i], starts[i] + every, ... (one round)."""
    out = []
    for i, start in enumerate(starts):
        key = reply_routing_key(JOB, f"client-{i}")
        out += [(start + n * every, key, BIG) for n in range(steps)]
    return sorted(out)


def test_window_spans_the_time_all_clients_are_busy() -> None:
    # Client i replies at i/2, i/2 + 1, ..., i/2 + 5. With warm=2 the window opens at the 2nd
    # reply of the last starter (client 3, t=2.5) and closes at the last reply of the first
    # finisher (client 0, t=5).
    trace = replies([0.0, 0.5, 1.0, 1.5], steps=6)
    [(start, end, count)] = windows(trace, case(steps=6, rounds=1, warm=2), JOB, BIG)[0]
    assert (start, end) == (2.5, 5.0)
    # In (2.5, 5]: client 0 at 3, 4, 5; client 1 at 3.5, 4.5; client 2 at 3, 4, 5; client 3
    # at 3.5, 4.5.
    assert count == 10


def test_each_round_is_its_own_window_and_small_replies_are_ignored() -> None:
    first = replies([0.0, 0.0, 0.0, 0.0], steps=4)
    second = replies([100.0, 100.0, 100.0, 100.0], steps=4)
    stale = [(50.0, reply_routing_key(JOB, "client-0"), 10)]
    spans, problem = windows(first + stale + second, case(steps=4, rounds=2, warm=1), JOB, BIG)
    assert problem == ""
    assert [(s, e) for s, e, _ in spans] == [(0.0, 3.0), (100.0, 103.0)]
    assert [c for _, _, c in spans] == [12, 12]


def test_a_missing_reply_is_a_problem_not_a_number() -> None:
    trace = replies([0.0, 0.0, 0.0, 0.0], steps=4)[:-1]
    spans, problem = windows(trace, case(steps=4, rounds=1, warm=1), JOB, BIG)
    assert spans == [] and "expected 4 gradient replies" in problem


def test_warm_must_leave_a_window() -> None:
    with pytest.raises(ValueError):
        windows([], case(steps=4, rounds=1, warm=4), JOB, BIG)


def test_in_process_variants() -> None:
    assert variant_threads("1") == (1, False)
    assert variant_threads("2p") == (2, True)
    with pytest.raises(ValueError):
        variant_threads("0")
