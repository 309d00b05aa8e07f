"""The coordinator's stream of the run's schedule record (issue 36): joins, leaves and drops
(members gone silent), each with its partition and shard, written when it happens; and the
shard a new member gets, by partition in a deterministic job, least-loaded otherwise."""

from __future__ import annotations

from broker.memory_store import InMemoryWeightStore
from broker.messages import Leave, new_message_id
from services.common.schedule import COORDINATOR_STREAM, MemberEvent, decode
from services.coordinator.joining import choose_shard
from tests.unit.test_aggregator_peers import ManualClock, make_settings
from tests.unit.test_coordinator import Desk, settings_for


def recorded(desk: Desk) -> list[MemberEvent]:
    lines = desk.store.read_schedule(desk.job).get(COORDINATOR_STREAM, [])
    events = [decode(line) for line in lines]
    assert all(isinstance(e, MemberEvent) for e in events)
    return events  # type: ignore[return-value]


def test_choose_shard_by_partition_when_deterministic() -> None:
    # Whatever the loads (which depend on join order), partition p goes to shard p % shards.
    for loads in ({}, {0: 5}, {1: 3, 0: 0}):
        got = [choose_shard(2, 6, p, loads, deterministic=True) for p in range(6)]
        assert got == [0, 1, 0, 1, 0, 1]


def test_choose_shard_least_loaded_when_not_deterministic() -> None:
    assert choose_shard(2, 6, 4, {0: 2, 1: 1}) == 1
    assert choose_shard(2, 6, 4, {0: 1, 1: 1}) == 0  # ties to the lowest index
    assert choose_shard(3, 6, 0, {0: 1, 1: 1}, deterministic=False) == 2
    # One shard per client (SFL-V1): the partition's own shard either way.
    assert choose_shard(3, 3, 1, {1: 4}) == 1


def test_join_order_decides_shards_only_when_not_deterministic(job: str) -> None:
    shards = {}
    for deterministic in (True, False):
        settings = make_settings(
            f"{job}{int(deterministic)}",
            job={"deterministic": deterministic},
            algorithm={"name": "sfl", "shards": 2},
            clients={"count": 4, "min_to_start": 1},
        )
        desk = Desk(settings)
        with desk.serving():
            # Partitions 0 and 2 first: least-loaded puts them on shards 0 and 1.
            for client, index in (("a", "0"), ("b", "2")):
                desk.join(client, index=index)
                desk.welcome(client)
        shards[deterministic] = {c: desk.member(c).shard for c in "ab"}
    assert shards[True] == {"a": 0, "b": 0}
    assert shards[False] == {"a": 0, "b": 1}


def test_joins_and_leaves_are_recorded_as_they_happen(job: str) -> None:
    desk = Desk(settings_for(job, algorithm={"name": "sfl", "shards": 2}, clients={"count": 4}))
    with desk.serving():
        for client in "abc":
            desk.join(client)
            desk.welcome(client)
        # Written when it happened, not at the end: the record is on the store already.
        assert [e.client for e in recorded(desk)] == ["a", "b", "c"]
        desk.join("a")  # a re-join of a live member is no new join (handled before the rest)
        desk.send(Leave(job, "b", new_message_id(), 1, "bye"))
        desk.join("b")  # a join after leaving is
        desk.welcome("b")
    assert recorded(desk) == [
        MemberEvent("join", "a", 0, partition=0, shard=0),
        MemberEvent("join", "b", 0, partition=1, shard=1),
        MemberEvent("join", "c", 0, partition=2, shard=0),
        MemberEvent("leave", "b", 0, partition=1, shard=1),
        MemberEvent("join", "b", 0, partition=1, shard=1),
    ]


def test_a_silent_member_is_recorded_as_dropped(job: str) -> None:
    store_clock = ManualClock()
    desk = Desk(
        settings_for(job, clients={"heartbeat_ttl_s": 10.0}),
        store=InMemoryWeightStore(clock=store_clock),
    )
    with desk.serving():
        desk.join("a", index="2")
        desk.welcome("a")
        store_clock.advance(10.5)  # a's record expires
        desk.clock.advance(60.0)  # the next sweep notices
        desk.event()  # member_joined
        desk.event()  # member_left (expired): recorded before it was announced
    assert recorded(desk) == [
        MemberEvent("join", "a", 0, partition=2, shard=0),
        MemberEvent("drop", "a", 0, partition=2, shard=0),
    ]
