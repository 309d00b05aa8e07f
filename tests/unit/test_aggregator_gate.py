"""The round's pure parts: cohort sampling, quorum, the screen and the verdict on each update."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from pydantic import ValidationError

from broker.memory_store import InMemoryWeightStore
from broker.messages import RoundDropped, WeightsUpdate
from broker.transport import Delivery
from services.aggregator.gate import (
    MemberBook,
    TensorsFit,
    Verdict,
    has_samples,
    reference_of,
)
from services.aggregator.round_gate import (
    ClosedGate,
    Decision,
    OpenRound,
    quorum_size,
    sample_cohort,
    wrong_version,
)
from services.common.checks.chain import first_rejection
from services.common.membership import MemberInfo, member_id
from services.config.job import ClientsSection
from tests.unit.test_aggregator_peers import ManualClock, add_member

REF = {"blocks.0.weight": torch.zeros(2, 3), "blocks.0.bias": torch.zeros(2)}


def cohort(*clients: str) -> dict[str, MemberInfo]:
    return {c: MemberInfo(c, 0, "block1", 10, i) for i, c in enumerate(clients)}


def open_round(*clients: str, deadline_s: float = 10.0, quorum: float = 0.5) -> OpenRound:
    return OpenRound(
        round=3,
        version=4,
        cohort=cohort(*clients),
        opened_at=100.0,
        deadline_s=deadline_s,
        quorum=quorum,
        client_ref=reference_of(REF),
        aux_ref={},
        earlier=frozenset({"old"}),
    )


def update(
    client: str,
    weights: dict[str, torch.Tensor] | None = None,
    *,
    round_: int = 3,
    version: int = 4,
) -> WeightsUpdate:
    state = weights or {n: torch.ones_like(t) for n, t in REF.items()}
    return WeightsUpdate("j", client, "m", version, round_, 10, state, {})


def test_sample_cohort_is_seeded_sized_and_order_free() -> None:
    pool = [f"c{i}" for i in range(10)]
    first = sample_cohort(pool, 3, seed=1, round_index=0)
    assert len(first) == 3 and set(first) <= set(pool)
    assert first == sample_cohort(reversed(pool), 3, seed=1, round_index=0)
    draws = {tuple(sample_cohort(pool, 3, seed=1, round_index=r)) for r in range(10)}
    assert len(draws) > 1  # rounds draw different cohorts
    assert first != sample_cohort(pool, 3, seed=1, round_index=0, attempt=1)
    assert sample_cohort(pool, 0, seed=1, round_index=0) != []
    assert sample_cohort(pool, 10, seed=1, round_index=0) == sorted(pool)
    assert sample_cohort(pool, 50, seed=1, round_index=0) == sorted(pool)
    assert sample_cohort([], 1, seed=1, round_index=0) == []


def test_cohort_size_by_fraction_or_count() -> None:
    by_fraction = ClientsSection(count=1000, fraction=0.1)
    assert [by_fraction.cohort_size(n) for n in (0, 1, 4, 15, 1000)] == [0, 1, 1, 2, 100]
    by_count = ClientsSection(count=1000, per_round=100)
    assert [by_count.cohort_size(n) for n in (0, 30, 100, 1000)] == [0, 30, 100, 100]
    assert ClientsSection().cohort_size(7) == 7  # the default: every member


def test_cohort_size_settings_that_conflict_are_refused() -> None:
    with pytest.raises(ValidationError, match="set one of them"):
        ClientsSection(count=1000, fraction=0.1, per_round=100)
    with pytest.raises(ValidationError, match=r"per_round \(20\) exceeds clients.count \(10\)"):
        ClientsSection(count=10, per_round=20)


def test_quorum_size() -> None:
    assert [quorum_size(n, 0.5) for n in (1, 2, 3, 4, 5)] == [1, 1, 2, 2, 3]
    assert quorum_size(10, 0.3) == 3
    assert quorum_size(3, 1.0) == 3


def test_verdicts() -> None:
    state = open_round("a", "b")
    assert state.offer(update("a")).verdict is Verdict.ACCEPT
    assert state.offer(update("a")).verdict is Verdict.DUPLICATE
    assert state.offer(update("b", round_=2, version=3)).verdict is Verdict.LATE
    assert state.offer(update("old")).verdict is Verdict.LATE  # an abandoned attempt's member
    rejected = {
        "stranger": update("stranger"),
        "future": update("b", round_=4),
        "stale version": update("b", version=3),
        # Late ones too must name their round's version (round r trains version r + 1).
        "late, another version": update("b", round_=2, version=999),
        "an abandoned attempt's, another version": update("old", version=999),
    }
    for what, message in rejected.items():
        offer = state.offer(message)
        assert offer.verdict is Verdict.REJECT, what
        assert offer.reason, what
    assert set(state.updates) == {"a"}
    assert ClosedGate(3).offer(update("a")).verdict is Verdict.LATE
    assert ClosedGate(2).offer(update("a")).verdict is Verdict.REJECT
    assert ClosedGate(3).offer(update("a", version=999)).kind == "wrong_version"


def test_a_late_message_must_name_its_rounds_version() -> None:
    """Junk in a member's name (issue 33: 9,000 RoundDropped of version 999) is not taken for
    a late message, which is acked (an update answered `round_closed`)."""
    assert wrong_version(update("a", round_=2, version=3)) is None
    assert wrong_version(RoundDropped("j", "a", "m", 1, 0, "aborted")) is None
    for message in (
        update("a", round_=2, version=999),
        RoundDropped("j", "a", "m", 999, 0, "aborted"),
        RoundDropped("j", "a", "m", 1, 1, "aborted"),
    ):
        offer = wrong_version(message)
        assert offer is not None and offer.verdict is Verdict.REJECT
        assert offer.kind == "wrong_version"
        assert f"based on version {message.version}" in offer.reason
    state = open_round("a", "b")
    for drop in (
        RoundDropped("j", "b", "m", 999, 1, "aborted"),  # a closed round's
        RoundDropped("j", "old", "m", 999, 3, "aborted"),  # an abandoned attempt's
    ):
        assert state.offer_drop(drop).kind == "wrong_version"
        assert ClosedGate(3).offer_drop(drop).kind == "wrong_version"
    assert state.offer_drop(RoundDropped("j", "b", "m", 2, 1, "aborted")).verdict is Verdict.LATE
    assert state.declined == {}


def test_the_book_reads_the_members_once_a_refresh_and_forgets_who_left() -> None:
    clock, store = ManualClock(), InMemoryWeightStore()
    book = MemberBook(store, "j", clock, refresh_s=2.0, keep_s=10.0)
    for client in "ab":
        add_member(store, "j", client, samples=10)
    assert set(book.live()) == {"a", "b"}
    store.remove_member("j", member_id("a"))
    clock.advance(1.9)
    assert [book.recent() for _ in range(100)] == [None] * 100  # polls read nothing
    assert book.reads == 1
    clock.advance(0.1)
    assert set(book.recent() or {}) == {"b"}
    assert book.reads == 2
    assert book.get("a") is not None  # left lately: an update it sent is judged as anyone's
    clock.advance(10.0)
    book.live()
    assert set(book.departed) == set()
    assert book.get("a") is None  # a stranger now (its re-read finds nothing)
    assert book.reads == 4


def test_the_book_knows_members_and_recent_leavers_not_strangers() -> None:
    book = MemberBook(InMemoryWeightStore(), "j")
    book.live_now.update(cohort("a"))
    book.departed["gone"] = (cohort("gone")["gone"], 0.0)
    assert book.knows("a") and book.knows("gone")
    assert not book.knows("stranger")  # its re-read finds nothing


def test_the_screen_refuses_foreign_tensors_whatever_the_round() -> None:
    checks = (has_samples, TensorsFit(reference_of(REF), {}))
    delivery = Delivery(b"", "j.updates", "j", 1)
    refused: dict[str, tuple[WeightsUpdate, str]] = {
        "no samples": (replace(update("a"), samples=0), "no_samples"),
        "shape": (
            update("a", {"blocks.0.weight": torch.ones(3, 2), "blocks.0.bias": torch.ones(2)}),
            "wrong_tensors",
        ),
        "missing": (update("a", {"blocks.0.weight": torch.ones(2, 3)}), "wrong_tensors"),
        "unknown": (update("a", {**REF, "x": torch.ones(1)}, round_=0), "wrong_tensors"),
        "dtype": (
            update(
                "a",
                {
                    "blocks.0.weight": torch.ones(2, 3, dtype=torch.int64),
                    "blocks.0.bias": torch.ones(2),
                },
            ),
            "wrong_tensors",
        ),
        "mask": (
            replace(update("a"), masks={"x": torch.ones(1, dtype=torch.bool)}),
            "wrong_tensors",
        ),
    }
    for what, (message, kind) in refused.items():
        rejection = first_rejection(checks, delivery, message)
        assert rejection is not None and rejection.code == kind and rejection.detail, what
    # A closed round's: the gate's business.
    assert first_rejection(checks, delivery, update("a", round_=0)) is None


def test_accepted_weights_are_copies_in_the_versions_dtype() -> None:
    state = open_round("a")
    half = {n: torch.ones_like(t, dtype=torch.float16) for n, t in REF.items()}
    sent = update("a", half)
    state.offer(sent)
    kept = state.updates["a"].client_weights
    assert all(t.dtype == torch.float32 for t in kept.values())
    assert all(kept[n].data_ptr() != sent.client_weights[n].data_ptr() for n in kept)


def test_decisions() -> None:
    state = open_round("a", "b", "c")  # quorum 2 of 3, deadline 10 s after t=100
    assert state.decide(105.0) is Decision.WAIT
    state.offer(update("a"))
    assert state.decide(111.0) is Decision.WAIT  # past the deadline, below quorum
    assert state.decide(121.0) is Decision.CLOSE  # twice the deadline: close with what came
    state.offer(update("b"))
    assert state.decide(105.0) is Decision.WAIT
    assert state.decide(110.0) is Decision.CLOSE
    assert state.drop({c: state.cohort[c] for c in "ab"}) == ["c"]
    assert state.decide(101.0) is Decision.CLOSE  # nobody left to wait for

    empty = open_round("a")
    assert empty.decide(121.0) is Decision.REOPEN
    empty.drop({})
    assert empty.decide(100.0) is Decision.REOPEN


def test_a_member_live_as_another_process_is_no_longer_waited_for() -> None:
    """Left (or killed) and joined again between two reads of the members: the same id, but
    the new process never saw the round's assignment."""
    state = open_round("a", "b", "c")
    live = cohort("a", "b", "c")
    assert state.drop(live) == []
    live["b"] = replace(live["b"], samples=99)  # re-joined from the same process: kept
    live["c"] = replace(live["c"], session="restarted")
    assert state.drop(live) == ["c"]
    assert state.waiting() == {"a", "b"}
    state.offer(update("a"))
    state.offer(update("b"))
    assert state.decide(101.0) is Decision.CLOSE  # long before the deadline
