"""Rounds that get no valid update: reopened a few times, then the job fails with the reasons
(`rounds.max_empty_attempts`, services/aggregator/round_gate.py)."""

from __future__ import annotations

import math
import struct
import threading
from collections.abc import Callable

import pytest
import torch

from broker.codec import decode, encode
from broker.errors import DecodeError
from broker.messages import Event, RoundDropped, WeightsAssignment, WeightsUpdate
from broker.topology import events_queue
from services.aggregator.aggregator import Aggregator
from services.aggregator.gate import Verdict
from services.aggregator.inbox import decode_kind
from services.aggregator.round_gate import (
    ClosedGate,
    Decision,
    EmptyAttempt,
    EmptyStreak,
    OpenRound,
)
from services.common.membership import MemberInfo
from services.common.supervise import JobFailedError
from services.report.records import ListSink, VersionRecord
from tests.unit.test_aggregator import Job, wait_until
from tests.unit.test_aggregator_peers import (
    WAIT_S,
    FakeClient,
    ManualClock,
    client_loop,
    make_settings,
    running,
    worker_loop,
)

DEADLINE_S = 60.0
# A value no tensor of a real update holds: its float32 bytes are patched to NaN on the wire.
POISON = 1234.5


def nan_update(fake: FakeClient, assignment: WeightsAssignment) -> bytes:
    """`fake`'s update with every float weight NaN, as a diverged client's would be: the codec
    refuses to encode NaN, so the bytes are patched after encoding."""
    body = encode(fake.update(assignment, value=POISON))
    poisoned = body.replace(struct.pack("<f", POISON), struct.pack("<f", math.nan))
    assert poisoned != body
    return poisoned


def always_nan(fake: FakeClient, assignment: WeightsAssignment) -> list[bytes]:
    return [nan_update(fake, assignment)]


def run_until_failed(
    j: Job, aggregator: Aggregator, attempts: int
) -> tuple[JobFailedError, list[Event]]:
    """Run the job; each attempt, once every client's NaN update was dead-lettered, move the
    clock past twice the deadline. The aggregator must fail after `attempts` of them."""
    failures: list[JobFailedError] = []
    done = threading.Event()
    events = j.backends.open_broker("events")
    events.declare([events_queue(j.name, "test")])
    events.subscribe(events_queue(j.name, "test").name, prefetch=100)
    clock = aggregator_clock(aggregator)

    def aggregate(stop: threading.Event) -> None:
        try:
            aggregator.run(stop)
        except JobFailedError as exc:
            failures.append(exc)
        done.set()

    peers = [client_loop(j.backends, j.name, f) for f in j.clients.values()]
    peers.append(worker_loop(j.backends, j.name, j.settings.shards, j.worker))
    clients = len(j.clients)
    with running([*peers, aggregate]):
        for attempt in range(1, attempts + 1):
            wait_until(dead_lettered(aggregator, attempt * clients), f"attempt {attempt}'s NaNs")
            clock.advance(2 * DEADLINE_S + 1)
        assert done.wait(WAIT_S), "the aggregator did not end the job"
    seen: list[Event] = []
    while (delivery := events.get(0.0)) is not None:
        message = decode(delivery.body)
        assert isinstance(message, Event)
        seen.append(message)
    events.close()
    assert failures, "the job did not fail"
    return failures[0], seen


def dead_lettered(aggregator: Aggregator, count: int) -> Callable[[], bool]:
    return lambda: aggregator.inbox_stats.dead_lettered == count


def aggregator_clock(aggregator: Aggregator) -> ManualClock:
    clock = aggregator._clock
    assert isinstance(clock, ManualClock)
    return clock


def test_clients_sending_only_nan_fail_the_job_after_max_empty_attempts(job: str) -> None:
    settings = make_settings(job, rounds={"deadline_s": DEADLINE_S, "max_empty_attempts": 3})
    j = Job(settings)
    for fake in j.clients.values():
        fake.script = always_nan
    sink = ListSink()
    aggregator = Aggregator(j.settings, j.backends, sink=sink, clock=ManualClock())

    failure, events = run_until_failed(j, aggregator, attempts=3)

    reason = (
        "3 consecutive attempts at round 1 without one valid update; last reasons: non_finite ×3"
    )
    assert str(failure) == reason
    assert sink.status == f"failed: {reason}" and sink.records == []
    assert aggregator.stats.reopened == 2
    assert j.store.versions(job) == [1]
    # Every client was dismissed as when a job finishes, told why, and stopped.
    for fake in j.clients.values():
        last = fake.assignments()[-1]
        assert (last.participate, last.config["finished"]) == (False, True)
        assert last.config["status"] == f"failed: {reason}"
        assert len(fake.assignments()) == 4  # three attempts at round 0, then the dismissal
    ended = [e for e in events if e.kind == "job_finished"]
    assert [e.data["status"] for e in ended] == [f"failed: {reason}"]
    assert [e.data["attempt"] for e in events if e.kind == "round_opened"] == [0, 1, 2]


def test_a_bad_attempt_followed_by_good_ones_does_not_fail_the_job(job: str) -> None:
    # Each round's first attempt gets only NaN, its second valid updates: two empty attempts in
    # all, as many as the limit, but never two in a row.
    settings = make_settings(
        job, job={"rounds": 2}, rounds={"deadline_s": DEADLINE_S, "max_empty_attempts": 2}
    )
    j = Job(settings)
    seen: dict[str, list[int]] = {c: [] for c in j.clients}

    def nan_first(fake: FakeClient, assignment: WeightsAssignment) -> list[bytes]:
        seen[fake.client].append(assignment.round)
        if seen[fake.client].count(assignment.round) == 1:
            return [nan_update(fake, assignment)]
        return [encode(fake.update(assignment))]

    for fake in j.clients.values():
        fake.script = nan_first
    clock = ManualClock()
    sink = ListSink()
    aggregator = Aggregator(j.settings, j.backends, sink=sink, clock=clock)
    clients = len(j.clients)

    def past_each_bad_attempt() -> None:
        for bad in (1, 2):
            wait_until(dead_lettered(aggregator, bad * clients), f"bad attempt {bad}")
            clock.advance(2 * DEADLINE_S + 1)

    records: list[VersionRecord] = j.run(aggregator, past_each_bad_attempt)

    assert sink.status == "finished"
    assert [(r.version, r.round, r.participants) for r in records] == [(2, 1, 3), (3, 2, 3)]
    assert aggregator.stats.reopened == 2
    assert all(rounds == [0, 0, 1, 1] for rounds in seen.values()), seen


def open_round(cohort: str) -> OpenRound:
    members = {c: MemberInfo(c, 0, "block1", 10, i) for i, c in enumerate(cohort)}
    return OpenRound(0, 1, members, 0.0, DEADLINE_S, 0.5, {}, {})


def live(state: OpenRound, clients: str) -> dict[str, MemberInfo]:
    """The records of `clients` as the round was opened with: the same processes, live."""
    return {c: state.cohort[c] for c in clients}


def test_an_attempt_whose_whole_cohort_left_does_not_count() -> None:
    state = open_round("ab")
    state.drop({})  # both expired
    gone = EmptyAttempt.of(state, {})
    assert not gone.counts and gone.reasons() == "gone ×2"
    # Refusals meanwhile (anyone's garbage) do not make it count either.
    refused = EmptyAttempt.of(state, {"undecodable": 5})
    assert not refused.counts and refused.reasons() == "undecodable ×5, gone ×2"
    streak = EmptyStreak(limit=1)
    assert not streak.add(gone) and not streak.add(refused) and streak.count == 0
    # One member that stayed and sent nothing valid is enough.
    state = open_round("ab")
    state.drop(live(state, "a"))
    stayed = EmptyAttempt.of(state, {"non_finite": 1})
    assert stayed.counts and streak.add(stayed)
    assert stayed.reasons() == "non_finite ×1, gone ×1"


def test_reasons_say_which_members_sent_nothing() -> None:
    state = open_round("abcd")
    state.drop(live(state, "abc"))  # d left
    attempt = EmptyAttempt.of(state, {"non_finite": 1, "wrong_tensors": 1, "wrong_job": 0})
    # Three still awaited, two refused updates: one member sent nothing.
    assert attempt.reasons() == "non_finite ×1, wrong_tensors ×1, no_update ×1, gone ×1"
    assert EmptyAttempt.of(open_round("ab"), {}).reasons() == "no_update ×2"


@pytest.mark.parametrize("limit", [0, 3])
def test_the_limit_counts_consecutive_empty_attempts(limit: int) -> None:
    streak = EmptyStreak(limit)
    silent = EmptyAttempt.of(open_round("a"), {})
    fails = [streak.add(silent) for _ in range(5)]
    assert fails == ([False] * 5 if limit == 0 else [False, False, True, True, True])
    assert streak.failure(4, silent).startswith("5 consecutive attempts at round 5 without")


def test_a_poisoned_body_is_refused_as_non_finite() -> None:
    # The codec's wording, which `decode_kind` relies on.
    fake = FakeClient("a", 10, lambda r: 1.0)
    assignment = WeightsAssignment("j", "a", "m", 1, 0, True, {"w": torch.ones(3)}, {}, {})
    with pytest.raises(DecodeError) as caught:
        decode(nan_update(fake, assignment))
    assert decode_kind(caught.value.reason) == "non_finite"
    assert decode_kind("truncated prefix") == "undecodable"


# --- RoundDropped: a client says it has nothing to send -------------------------------------------


def drop_of(
    client: str,
    *,
    round_index: int = 0,
    version: int = 1,
    ref: str = "",
    reason: str = "non_finite",
) -> RoundDropped:
    return RoundDropped("j", client, f"drop-{client}", version, round_index, reason, ref)


def test_drops_end_an_attempt_at_once_and_count_by_reason() -> None:
    state = open_round("abc")
    assert state.offer_drop(drop_of("a")).verdict is Verdict.ACCEPT
    assert state.offer_drop(drop_of("b", reason="aborted")).verdict is Verdict.ACCEPT
    assert state.decide(0.0) is Decision.WAIT  # c is still awaited
    assert state.offer_drop(drop_of("c")).verdict is Verdict.ACCEPT
    # Every member answered, none with an update: reopen now, not at the deadline.
    assert state.decide(0.0) is Decision.REOPEN
    attempt = EmptyAttempt.of(state, {"non_finite": 1})  # and one NaN update dead-lettered
    assert attempt.counts and attempt.reasons() == "non_finite ×3, aborted ×1"
    # A replay is idempotent.
    assert state.offer_drop(drop_of("a")).verdict is Verdict.DUPLICATE
    assert state.declined == {"a": "non_finite", "b": "aborted", "c": "non_finite"}


def test_an_attempt_whose_members_all_declined_or_left_counts() -> None:
    state = open_round("ab")
    state.offer_drop(drop_of("a"))
    state.drop({})  # b expired
    attempt = EmptyAttempt.of(state, {})
    assert attempt.counts and attempt.reasons() == "non_finite ×1, gone ×1"


def test_a_drop_and_an_update_of_one_member() -> None:
    state = open_round("ab")
    state.offer_drop(drop_of("a"))
    update = WeightsUpdate("j", "a", "u-a", 1, 0, 5, {}, {})
    # A valid update outweighs the notice (say, a retry that worked)...
    assert state.offer(update).verdict is Verdict.ACCEPT
    assert state.declined == {} and set(state.updates) == {"a"}
    # ...and a notice after an update contradicts it.
    late = state.offer_drop(drop_of("a"))
    assert (late.verdict, late.kind) == (Verdict.REJECT, "contradicts_update")
    assert state.offer_drop(drop_of("b")).verdict is Verdict.ACCEPT
    assert state.decide(0.0) is Decision.CLOSE


@pytest.mark.parametrize(
    ("drop", "verdict", "kind", "reason"),
    [
        (drop_of("x"), Verdict.REJECT, "not_in_cohort", "client 'x' is not in round 1"),
        (drop_of("a", round_index=1), Verdict.REJECT, "not_open", "round 2 is not open (open: 1)"),
        (drop_of("a", version=2), Verdict.REJECT, "wrong_version", "based on version 2"),
        (drop_of("e"), Verdict.LATE, "rejected", "round 1 was reopened without you"),
        (drop_of("a", ref="old"), Verdict.LATE, "rejected", "an earlier assignment"),
    ],
)
def test_drops_that_do_not_belong_to_the_attempt(
    drop: RoundDropped, verdict: Verdict, kind: str, reason: str
) -> None:
    state = open_round("ab")
    state.earlier = frozenset({"e"})
    state.assigned = {"a": "now", "b": "now-b"}
    offer = state.offer_drop(drop)
    assert (offer.verdict, offer.kind) == (verdict, kind) and reason in offer.reason
    assert state.declined == {} and state.waiting() == {"a", "b"}
    # The notice that answers this attempt's assignment is taken.
    assert state.offer_drop(drop_of("a", ref="now")).verdict is Verdict.ACCEPT


def test_between_rounds_a_drop_is_late_or_premature() -> None:
    gate = ClosedGate(last=2)
    assert gate.offer_drop(drop_of("a", round_index=2, version=3)).verdict is Verdict.LATE
    forged = gate.offer_drop(drop_of("a", round_index=2, version=999))  # round 3 trains v3
    assert (forged.verdict, forged.kind) == (Verdict.REJECT, "wrong_version")
    premature = gate.offer_drop(drop_of("a", round_index=3))
    assert (premature.verdict, premature.kind) == (Verdict.REJECT, "not_open")


def always_drop(fake: FakeClient, assignment: WeightsAssignment) -> list[bytes]:
    drop = RoundDropped(
        assignment.job,
        fake.client,
        f"drop-{fake.client}-{assignment.message_id}",
        assignment.version,
        assignment.round,
        "non_finite",
        assignment.message_id,
        "client_weights['w']: holds NaN or infinite values",
    )
    return [encode(drop)]


def test_clients_that_declare_their_drops_fail_the_job_without_waiting(job: str) -> None:
    # The clock never moves: only the notices can end the attempts.
    settings = make_settings(job, rounds={"deadline_s": DEADLINE_S, "max_empty_attempts": 3})
    j = Job(settings)
    for fake in j.clients.values():
        fake.script = always_drop
    sink = ListSink()
    aggregator = Aggregator(j.settings, j.backends, sink=sink, clock=ManualClock())
    failures: list[JobFailedError] = []

    def aggregate(stop: threading.Event) -> None:
        try:
            aggregator.run(stop)
        except JobFailedError as exc:
            failures.append(exc)

    peers = [client_loop(j.backends, j.name, f) for f in j.clients.values()]
    peers.append(worker_loop(j.backends, j.name, j.settings.shards, j.worker))
    with running([*peers, aggregate]):
        wait_until(lambda: bool(failures), "the job's failure")

    reason = (
        "3 consecutive attempts at round 1 without one valid update; last reasons: non_finite ×3"
    )
    assert [str(f) for f in failures] == [reason]
    assert sink.status == f"failed: {reason}"
    assert aggregator.inbox_stats.drops == 9 and aggregator.inbox_stats.dead_lettered == 0
    for fake in j.clients.values():
        assert len(fake.assignments()) == 4  # three attempts at round 0, then the dismissal
