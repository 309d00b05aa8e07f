"""The coordinator's member index (services/coordinator/index.py, roster.py): the same choices
as a scan of all members, and no scan per event."""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Collection, Sequence

from broker.memory_store import InMemoryWeightStore
from broker.messages import Heartbeat, Leave, new_message_id
from broker.store import Member, MemberKind
from services.common.membership import MemberInfo, client_members, member_id
from services.coordinator.index import Deadlines, MemberIndex, Partitions
from services.coordinator.joining import choose_shard
from services.coordinator.roster import SYNC_SWEEPS, Roster
from tests.unit.test_aggregator_peers import ManualClock
from tests.unit.test_coordinator import Desk, settings_for


def scan_choice(requested: int | None, taken: Collection[int], count: int) -> int | None:
    """The rule as a scan of every index (what the coordinator did before the index)."""
    if requested is not None and 0 <= requested < count and requested not in taken:
        return requested
    return next((i for i in range(count) if i not in taken), None)


def member(client: str, partition: int, shard: int = 0) -> MemberInfo:
    return MemberInfo(client=client, shard=shard, cut="block1", samples=10, partition=partition)


def test_partitions_choose_as_a_scan_does_through_random_churn() -> None:
    rng = random.Random(7)
    for count in (1, 5, 40):
        partitions, held = Partitions(count), Counter[int]()
        for _ in range(2000):
            if held and rng.random() < 0.45:
                gone = rng.choice(sorted(held.elements()))
                partitions.release(gone)
                held[gone] -= 1
                held += Counter()  # drops the zero
            else:
                requested = rng.choice([None, rng.randrange(-2, count + 3)])
                expected = scan_choice(requested, set(held), count)
                assert partitions.choose(requested) == expected
                if expected is not None:
                    partitions.take(expected)
                    held[expected] += 1
                elif rng.random() < 0.3:  # a record holding a partition twice, as a store may
                    doubled = rng.choice(sorted(held))
                    partitions.take(doubled)
                    held[doubled] += 1
            assert partitions.lowest_free() == scan_choice(None, set(held), count)


def test_the_index_tracks_holders_and_shard_loads() -> None:
    index = MemberIndex(4, [member("a", 0, 0), member("b", 1, 1), member("c", 2, 1)])
    assert (len(index), dict(index.loads), index.partitions.lowest_free()) == (3, {0: 1, 1: 2}, 3)
    assert choose_shard(2, 4, 3, index.loads) == 0
    index.add(member("b", 3, 0))  # b's record replaced: its old partition and shard freed
    assert (index.holders(1), index.holders(3), dict(index.loads)) == (set(), {"b"}, {0: 2, 1: 1})
    assert index.partitions.choose(None) == 1
    assert index.discard("a") == member("a", 0, 0) and index.discard("a") is None
    assert (index.partitions.choose(None), "a" in index, dict(index.loads)) == (
        0,
        False,
        {0: 1, 1: 1},
    )


class CountingStore(InMemoryWeightStore):
    """Counts the reads of all members."""

    scans = 0

    def live_members(self, job: str, kind: MemberKind | None = None) -> dict[str, Member]:
        self.scans += 1
        return super().live_members(job, kind)


def test_joins_heartbeats_and_leaves_read_no_list_of_members(job: str) -> None:
    store = CountingStore()
    desk = Desk(settings_for(job, clients={"count": 30}), store=store)
    with desk.serving():
        for i in range(20):
            desk.join(f"c{i}")
            desk.welcome(f"c{i}")
        scans_after_start = store.scans
        for _ in range(5):
            for i in range(20):
                desk.send(Heartbeat(job, f"c{i}", new_message_id(), 1))
        desk.send(Leave(job, "c3", new_message_id(), 1, "bye"))
        desk.join("late")
        assert desk.welcome("late").config["partition"] == 3  # c3's, freed by its Leave

    assert scans_after_start <= 1  # the start's sync; the manual clock runs no sweep
    assert store.scans == scans_after_start
    assert desk.coordinator.stats.heartbeats == 100


def roster_over(
    store: InMemoryWeightStore, job: str, clock: ManualClock
) -> tuple[Roster, list[str]]:
    expired: list[str] = []
    roster = Roster(store, job, count=3, ttl_s=10.0, expired=expired.extend, clock=clock)
    return roster, expired


def test_an_expired_member_found_by_a_read_of_it_is_announced_once(job: str) -> None:
    store_clock, clock = ManualClock(), ManualClock()
    store = InMemoryWeightStore(clock=store_clock)
    roster, expired = roster_over(store, job, clock)
    roster.record(member("a", 0))
    roster.record(member("b", 1))
    store_clock.advance(11.0)
    roster.record(member("c", 2))
    assert roster.renew(["a", "c"]) == [False, True]
    assert expired == ["a"] and "a" not in roster.index
    roster.sync()  # b is found gone now; a is not announced again
    assert expired == ["a", "b"] and roster.index.clients() == {"c"}
    assert set(client_members(store, job)) == {"c"}


def test_a_join_finds_the_slot_of_a_member_that_expired_between_syncs(job: str) -> None:
    store_clock = ManualClock()
    desk = Desk(
        settings_for(job, clients={"count": 2, "heartbeat_ttl_s": 10.0}),
        store=InMemoryWeightStore(clock=store_clock),
    )
    with desk.serving():
        desk.join("a", index="0")
        desk.welcome("a")
        desk.join("b")
        desk.welcome("b")
        store_clock.advance(11.0)  # both expire; the coordinator's clock runs no sweep
        desk.join("c", index="0")  # a's partition: a is read, found gone
        c = desk.welcome("c")
        desk.clock.advance(1.5)  # the full-job sync may run
        desk.join("d")  # the index still holds b: the job looks full until it syncs
        d = desk.welcome("d")

    assert (c.config["partition"], d.config["partition"]) == (0, 1)
    assert set(client_members(desk.store, job)) == {"c", "d"}
    assert desk.coordinator.stats.expired == 2 and desk.coordinator.stats.refused == 0


def test_deadlines_give_what_is_due_as_a_scan_does_through_random_churn() -> None:
    rng = random.Random(3)
    deadlines = Deadlines(0.5)
    model: dict[str, float] = {}  # member -> when due (its bucket's end)
    now = 1_000.0
    for _ in range(3_000):
        member = f"m{rng.randrange(40)}"
        action = rng.random()
        if action < 0.6:
            at = now + rng.uniform(0.0, 10.0)
            deadlines.set(member, at)
            model[member] = math.ceil(at / 0.5) * 0.5
            assert model[member] >= at, "never due before its deadline"
        elif action < 0.7:
            deadlines.drop(member)
            model.pop(member, None)
        else:
            now += rng.choice([0.1, 0.7, 3.0, 40.0])  # short steps and long gaps
            expected = {m for m, at in model.items() if at <= now}
            assert set(deadlines.due(now)) == expected
            for m in expected:
                del model[m]
        assert len(deadlines) == len(model) and all(m in deadlines for m in model)


class SweepStore(InMemoryWeightStore):
    """Records the reads of all members and the ids each `member_ttls` asks about."""

    def __init__(self, clock: ManualClock) -> None:
        super().__init__(clock=clock)
        self.scans = 0
        self.asked: list[list[str]] = []

    def live_members(self, job: str, kind: MemberKind | None = None) -> dict[str, Member]:
        self.scans += 1
        return super().live_members(job, kind)

    def member_ttls(self, job: str, member_ids: Sequence[str]) -> list[float | None]:
        self.asked.append(list(member_ids))
        return super().member_ttls(job, member_ids)


def test_a_sweep_asks_about_the_members_past_their_deadline_only(job: str) -> None:
    store_clock, clock = ManualClock(), ManualClock()
    store = SweepStore(store_clock)
    expired: list[str] = []
    roster = Roster(store, job, count=100, ttl_s=10.0, expired=expired.extend, clock=clock)
    roster.sync()
    for i in range(100):
        roster.record(member(f"c{i}", i))
    for _ in range(3):  # 90 keep heartbeating; c90..c99 stop
        clock.advance(4.0)
        store_clock.advance(4.0)
        assert roster.renew([f"c{i}" for i in range(90)]) == [True] * 90
        roster.sweep()
    # Only the third sweep (12 s) found members past their deadline (10 s): the ten that stopped.
    assert [set(ids) for ids in store.asked] == [{member_id(f"c{i}") for i in range(90, 100)}]
    assert sorted(expired) == [f"c{i}" for i in range(90, 100)], "each expiry announced"
    store.asked.clear()
    clock.advance(4.0)  # the others are not due yet: nothing is asked, nothing announced
    roster.sweep()
    assert store.asked == [] and len(expired) == 10
    assert store.scans == 1, "only the start's sync read every member"
    assert roster.index.clients() == {f"c{i}" for i in range(90)}
    assert set(client_members(store, job)) == roster.index.clients()


def test_a_sweep_finds_expiries_pruned_by_another_reader_and_keeps_the_live(job: str) -> None:
    store_clock, clock = ManualClock(), ManualClock()
    store = SweepStore(store_clock)
    roster, expired = roster_over(store, job, clock)
    roster.record(member("a", 0))
    roster.record(member("b", 1))
    store.heartbeat(job, member_id("b"), 30.0, member("b", 1).to_info())  # not by the roster
    clock.advance(11.0)
    store_clock.advance(11.0)
    assert set(client_members(store, job)) == {"b"}  # a reader prunes a: the roster never saw it
    roster.sweep()
    assert [sorted(ids) for ids in store.asked] == [[member_id("a"), member_id("b")]]
    assert expired == ["a"] and roster.index.clients() == {"b"}
    clock.advance(11.0)  # b is due again when the store said: 19 s after the sweep
    roster.sweep()
    assert expired == ["a"] and len(store.asked) == 1
    clock.advance(9.0)
    store_clock.advance(20.0)
    roster.sweep()
    assert expired == ["a", "b"] and len(roster.index) == 0


def test_every_nth_sweep_reads_every_member_for_records_written_by_others(job: str) -> None:
    store_clock, clock = ManualClock(), ManualClock()
    store = SweepStore(store_clock)
    roster, _ = roster_over(store, job, clock)
    roster.sync()
    store.heartbeat(job, member_id("x"), 600.0, member("x", 2).to_info())  # another writer
    for _ in range(SYNC_SWEEPS - 1):
        roster.sweep()
    assert "x" not in roster.index and store.scans == 1
    roster.sweep()
    assert "x" in roster.index and store.scans == 2
    assert roster.index.partitions.choose(2) == 0, "x's partition counts as taken"
