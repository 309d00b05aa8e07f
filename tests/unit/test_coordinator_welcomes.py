"""Which Joins are welcomed, and each session's seq base (issue 33, points 2 and 4): the rule
alone, then the coordinator over the in-memory hub and store."""

from __future__ import annotations

from broker.memory_store import InMemoryWeightStore
from broker.messages import Welcome
from broker.store import Member
from services.common.membership import MemberInfo
from services.coordinator.joining import seq_base_after
from services.coordinator.welcomes import REWELCOME_S, Verdict, WelcomeLimit
from tests.unit.test_aggregator_peers import ManualClock
from tests.unit.test_coordinator import Desk, settings_for
from tests.unit.test_coordinator_hosts import dead_reasons


def test_a_handled_join_id_is_a_replay_however_late() -> None:
    clock = ManualClock()
    limit = WelcomeLimit(clock)
    assert limit.judge("a", "j1", "s1", member=False) is Verdict.WELCOME
    with limit.sending("a", "j1", "s1"):
        pass
    clock.advance(10 * REWELCOME_S)
    assert limit.judge("a", "j1", "s1", member=True) is Verdict.REPLAYED
    assert limit.judge("b", "j1", "s1", member=False) is Verdict.WELCOME  # ids are per client


def test_one_welcome_per_client_per_interval() -> None:
    clock = ManualClock()
    limit = WelcomeLimit(clock)
    with limit.sending("a", "j1", "s1"):
        pass
    clock.advance(REWELCOME_S / 2)
    assert limit.judge("a", "j2", "s1", member=True) is Verdict.WITHHOLD
    assert limit.judge("a", "j2", "s1", member=True) is Verdict.REPLAYED  # withheld: handled
    assert limit.judge("a", "j3", "s2", member=True) is Verdict.TOO_SOON
    # Its record gone (expired at once, say): a Welcome is its only way back in.
    assert limit.judge("a", "j4", "s1", member=False) is Verdict.WELCOME
    clock.advance(REWELCOME_S / 2)
    assert limit.judge("a", "j5", "s1", member=True) is Verdict.WELCOME
    assert limit.judge("a", "j6", "s2", member=True) is Verdict.WELCOME
    with limit.sending("a", "j6", "s2"):
        pass
    assert limit.judge("a", "j1", "s1", member=True) is Verdict.REPLAYED  # an old session's
    limit.forget("a")  # left or expired
    assert limit.judge("a", "j7", "s3", member=False) is Verdict.WELCOME


def test_a_new_base_is_the_clock_and_above_the_previous_one() -> None:
    assert seq_base_after(0, 1_000) == 1_000
    assert seq_base_after(500, 1_000) == 1_000
    assert seq_base_after(5_000, 1_000) == 5_001  # this coordinator's clock is behind


def test_member_info_keeps_the_seq_base() -> None:
    info = MemberInfo("a", 0, "block1", 10, 1, (2,), 1.5, "s1", seq_base=123)
    stored = info.to_info()
    assert stored["seq_base"] == "123"
    legacy = {k: v for k, v in stored.items() if k != "seq_base"}
    assert MemberInfo.from_member(Member("client:a", 0.0, stored)) == info
    old = MemberInfo.from_member(Member("client:a", 0.0, legacy))
    assert old is not None and old.seq_base == 0  # written before seq bases: unknown


def test_replays_of_a_join_are_dead_lettered_and_welcomed_once(job: str) -> None:
    desk = Desk(settings_for(job))
    with desk.serving():
        join = desk.join("a", index="1", session="s1")
        for _ in range(5):
            desk.send(join)
        desk.join("b")
        desk.welcome("b")  # handled after a's: one queue, in order
        first = desk.reply("a", 0.5)
        second = desk.reply("a", 0.2)
        desk.clock.advance(REWELCOME_S)
        desk.send(join)  # still a replay, however late
        desk.join("c")
        desk.welcome("c")
        late = desk.reply("a", 0.2)

    assert isinstance(first, Welcome) and second is None and late is None
    reasons = dead_reasons(desk)
    assert len(reasons) == 6 == desk.coordinator.stats.replays
    assert all(r.startswith(f"replayed_join: Join {join.message_id} ") for r in reasons)


def test_a_join_of_a_session_just_welcomed_is_recorded_without_a_welcome(job: str) -> None:
    """The client's re-Join that reports the samples of the partition its Welcome assigned."""
    desk = Desk(settings_for(job))
    with desk.serving():
        desk.join("a", samples=0, session="s1")
        welcome = desk.welcome("a")
        desk.join("a", samples=60, index=str(welcome.config["partition"]), session="s1")
        desk.join("b")
        desk.welcome("b")
        nothing = desk.reply("a", 0.2)

    assert nothing is None and desk.member("a").samples == 60
    assert desk.coordinator.stats.withheld == 1 and dead_reasons(desk) == []


def test_each_session_has_its_base_and_a_later_one_starts_above(job: str) -> None:
    store_clock = ManualClock()
    desk = Desk(
        settings_for(job, clients={"heartbeat_ttl_s": 10.0}),
        store=InMemoryWeightStore(clock=store_clock),
    )
    with desk.serving():
        desk.join("a", session="s1")
        first = desk.welcome("a")
        recorded = desk.member("a").seq_base
        desk.clock.advance(REWELCOME_S)
        desk.join("a", session="s1")  # its Welcome lost, say: asks again
        again = desk.welcome("a")
        desk.clock.advance(REWELCOME_S)
        desk.join("a", session="s2")  # a new process
        restarted = desk.welcome("a")
        store_clock.advance(11.0)  # its record expires
        desk.clock.advance(REWELCOME_S)
        desk.join("a", session="s2")  # told unknown_member, it joins again
        back = desk.welcome("a")
        final = desk.member("a").seq_base

    assert first.seq_base > 0 and recorded == first.seq_base == again.seq_base
    assert restarted.seq_base > first.seq_base
    assert back.seq_base > restarted.seq_base and final == back.seq_base


def test_a_new_session_a_moment_after_a_welcome_is_welcomed_after_the_interval(
    job: str,
) -> None:
    """A client restarted (or back from offline) right after its Welcome: nothing at once, no
    dead letter (it did nothing wrong), its Welcome once the interval is over without asking
    again; of several such Joins the latest is answered (issue 33: the 200-client churn)."""
    desk = Desk(settings_for(job))
    with desk.serving():
        desk.join("a", session="s1")
        desk.welcome("a")
        desk.join("a", session="s2")
        desk.join("a", session="s3")
        desk.join("b")
        desk.welcome("b")
        at_once = desk.reply("a", 0.2)
        session_then = desk.member("a").session
        desk.clock.advance(REWELCOME_S)
        later = desk.welcome("a")
        nothing_more = desk.reply("a", 0.2)

    assert at_once is None and session_then == "s1"
    assert isinstance(later, Welcome) and desk.member("a").session == "s3"
    assert nothing_more is None
    assert dead_reasons(desk) == [] and desk.coordinator.stats.deferred == 2
