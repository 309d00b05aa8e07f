"""The shard's per-client rules of issue 33, one concern a test: session seq windows, genuine
copies, credit per round, the surplus of refusals, and the member records behind them."""

from __future__ import annotations

import threading
from collections import Counter
from types import SimpleNamespace

import torch

from broker.memory_store import InMemoryWeightStore
from broker.messages import SmashedBatch
from broker.transport import Delivery
from services.common.backends import Backends
from services.common.membership import MemberInfo, member_id
from tests.unit.test_async_worker import setup as async_setup
from tests.unit.test_worker_support import random_batch
from workers.gate import (
    SLACK,
    ClientGate,
    Credit,
    SessionSeqs,
    StepRule,
    Surplus,
    copy_problem,
    round_steps,
    window_problem,
)
from workers.members import MemberCache
from workers.worker import Worker


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_window_runs_from_the_session_base_to_the_top_taken_plus_credit() -> None:
    assert window_problem(1000, 1000, 999, 4) is None
    assert window_problem(1003, 1000, 999, 4) is None
    assert "below its session's first seq 1000" in str(window_problem(999, 1000, 999, 4))
    assert "beyond" in str(window_problem(1004, 1000, 999, 4))
    assert "beyond" in str(window_problem(10**9, 1000, 1500, 4))


def test_a_record_without_a_base_has_no_window() -> None:
    assert window_problem(10**15, 0, 5, 4) is None
    assert window_problem(1, 0, None, 4) is None


def test_a_copy_carries_the_applied_message_id() -> None:
    assert copy_problem(7, "m1", "m1") is None
    assert copy_problem(7, "m2", None) is None  # not kept (older checkpoint): a copy
    reused = copy_problem(7, "m2", "m1")
    assert reused is not None and reused.code == "seq_reused"
    assert "m1" in reused.detail and "m2" in reused.detail


def test_a_forged_seq_far_ahead_does_not_move_the_window() -> None:
    seqs = SessionSeqs(lambda client, again: 1000)
    assert seqs.problem("a", 10**9, 4, None) is not None
    assert seqs.problem("a", 1000, 4, None) is None
    seqs.took("a", 1000)
    assert seqs.problem("a", 1004, 4, None) is None
    assert seqs.problem("a", 1005, 4, None) is not None


def test_a_seq_outside_the_window_asks_for_a_new_session() -> None:
    bases = {"a": 1000}
    asked: list[bool] = []

    def lookup(client: str, again: bool) -> int:
        asked.append(again)
        return bases[client]

    seqs = SessionSeqs(lookup)
    assert seqs.problem("a", 1000, 4, None) is None
    bases["a"] = 5000  # the client joined again
    assert seqs.problem("a", 5000, 4, 1000) is None
    assert asked == [False, True]
    refused = seqs.problem("a", 1001, 4, 1000)  # the old session's
    assert refused is not None and refused.code == "bad_seq"


def test_the_window_starts_above_what_the_replica_applied_in_the_session() -> None:
    seqs = SessionSeqs(lambda client, again: 1000)
    assert seqs.problem("a", 1060, 4, 1057) is None  # a take-over: 1057 applied already
    seqs.forget()
    assert seqs.problem("a", 1062, 4, 1057) is not None


def test_round_steps_follow_the_clients_rule() -> None:
    assert round_steps(16, batch_size=8, local_epochs=1, max_steps=0) == 2
    assert round_steps(17, batch_size=8, local_epochs=2, max_steps=0) == 6
    assert round_steps(1000, batch_size=8, local_epochs=1, max_steps=5) == 5
    assert round_steps(0, batch_size=8, local_epochs=1, max_steps=0) == 0
    assert StepRule(8, 1, 0).allowance(16) == 4 + SLACK


def test_credit_counts_per_client_and_round() -> None:
    credit = Credit()
    assert [credit.spend("a", 0, 2) for _ in range(3)] == [True, True, False]
    assert credit.spend("b", 0, 2)
    credit.new_round()
    assert credit.spend("a", 0, 2)


def test_credit_of_stale_versions_is_forgotten() -> None:
    credit = Credit()
    assert credit.spend("a", 3, 1) and not credit.spend("a", 3, 1)
    credit.forget_before(4)
    assert credit.spend("a", 3, 1)


def delivery(tag: int) -> Delivery:
    return Delivery(body=b"", queue="q", routing_key="q", tag=tag)


def test_the_surplus_is_due_when_full_or_old() -> None:
    clock = Clock()
    surplus = Surplus(size=3, wait_s=0.5, clock=clock)
    assert not surplus.due()
    surplus.add(delivery(1), "over_budget: x")
    surplus.add(delivery(2), "over_budget: x")
    assert not surplus.due()
    clock.now += 0.5
    assert surplus.due()
    assert [d.tag for d, _ in surplus.take()] == [1, 2] and not surplus
    for tag in range(3):
        surplus.add(delivery(tag), "r")
    assert surplus.due()


def test_member_info_is_read_again_only_when_asked_and_not_too_often_per_client() -> None:
    store, clock = InMemoryWeightStore(), Clock()
    info = MemberInfo("a", 0, "block1", 16, 0, seq_base=1000)
    store.heartbeat("j", member_id("a"), 60.0, info.to_info())
    members = MemberCache(store, "j", clock)
    first = members.info("a")
    assert first is not None and first.seq_base == 1000
    store.heartbeat("j", member_id("a"), 60.0, {**info.to_info(), "seq_base": "5000"})
    assert members.info("a", again=True).seq_base == 1000  # type: ignore[union-attr]
    clock.now += 0.1
    assert members.info("a").seq_base == 1000  # type: ignore[union-attr]
    assert members.info("a", again=True).seq_base == 5000  # type: ignore[union-attr]
    store.heartbeat("j", member_id("a"), 60.0, {**info.to_info(), "seq_base": "9000"})
    clock.now += 0.5  # that client asked again less than a second ago: no read
    assert members.info("a", again=True).seq_base == 5000  # type: ignore[union-attr]
    clock.now += 0.5
    assert members.info("a", again=True).seq_base == 9000  # type: ignore[union-attr]
    assert members.info("nobody") is None and not members("nobody")


def test_refusals_are_logged_at_most_once_a_second_per_code() -> None:
    clock = Clock()
    surplus = Surplus(clock=clock)
    assert surplus.settled("bad_seq") == 1
    assert [surplus.settled("bad_seq") for _ in range(5)] == [0] * 5
    assert surplus.settled("over_budget") == 1
    clock.now += 1.0
    assert surplus.settled("bad_seq") == 6


def test_in_async_mode_a_client_has_its_allowance_per_version(job: str) -> None:
    # No round markers: the batches computed with one version are a round's worth.
    settings, embedded, model, client = async_setup(job)  # c0: 100 samples, batches of 64
    allowance = StepRule(64, 1, 0).allowance(100)
    gen = torch.Generator().manual_seed(5)
    for seq in range(allowance + 3):
        client.batch("c0", seq, *random_batch(model, gen, rows=1), version=1)
    stats = Worker(settings, Backends(settings.broker, settings.store, embedded)).run(
        threading.Event(), burst=True
    )
    assert stats.batches_applied == allowance
    assert stats.dead_lettered == Counter({"over_budget": 3})


def accepted(gate: ClientGate, client: str, n: int = 100) -> int:
    """How many of `n` batches of `client` the gate takes this round."""
    z, y = torch.zeros(1, 1), torch.zeros(1, dtype=torch.int64)
    batches = [SmashedBatch("j", client, f"m{s}", 1, s, 0, 0, 0, z, y) for s in range(n)]
    return sum(gate.take(b) is None for b in batches)


def test_a_cohort_members_allowance_is_kept_for_its_round_and_a_strangers_is_not() -> None:
    store, clock = InMemoryWeightStore(), Clock()
    info = MemberInfo("b", 0, "block1", 16, 0)
    store.heartbeat("j", member_id("b"), 60.0, info.to_info())
    replica = SimpleNamespace(cohort={"a": 16}, seqs={})
    gate = ClientGate(StepRule(8, 1, 0), MemberCache(store, "j", clock), replica)  # type: ignore[arg-type]
    assert accepted(gate, "a") == 2 * 2 + SLACK
    replica.cohort = {"a": 80}  # only a RoundStart changes the cohort, and says so
    gate.new_round()
    assert accepted(gate, "a") == 2 * 10 + SLACK
    assert accepted(gate, "b") == 2 * 2 + SLACK  # from its member record
    gate.new_round()
    store.heartbeat("j", member_id("b"), 60.0, {**info.to_info(), "samples": "40"})
    clock.now += 5
    assert gate.members("b")  # the membership check reads the records again
    assert accepted(gate, "b") == 2 * 5 + SLACK
