"""Shard leases: W workers share S shards, at most ceil(S/W) each, and hand them over."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from broker.memory_broker import InMemoryBroker
from broker.memory_store import InMemoryWeightStore
from broker.store import Member, MemberKind
from services.common.backends import Backends, Embedded
from services.common.leases import LeaseKeeper, home_shard, lease_name
from services.common.membership import member_id
from tests.contract.test_store_contract import lease_owner
from tests.unit.test_worker_support import (
    ScriptedClient,
    make_settings,
    one_torch_thread,
    random_batch,
    seed_version,
)
from workers.worker import Worker

__all__ = ["one_torch_thread"]  # the autouse fixture, imported so that it applies here


def settle(keepers: dict[str, LeaseKeeper], held: dict[str, set[int]], rounds: int = 6) -> None:
    """Let every keeper plan a few times, doing what each plan says."""
    for _ in range(rounds):
        for name, keeper in keepers.items():
            plan = keeper.plan(held[name])
            held[name] -= set(plan.lost)
            for shard in plan.release:
                keeper.release(shard)
                held[name].discard(shard)
            held[name] |= set(plan.acquired)


def assert_fair(
    store: InMemoryWeightStore, job: str, held: dict[str, set[int]], shards: int
) -> None:
    cap = math.ceil(shards / len(held))
    assert all(len(h) <= cap for h in held.values()), held
    owners = [lease_owner(store, job, lease_name(s)) for s in range(shards)]
    assert sorted(s for h in held.values() for s in h) == list(range(shards))  # no overlap
    for name, shards_held in held.items():
        assert all(owners[s] == name for s in shards_held)


def test_keepers_share_shards_fairly_as_workers_come_and_go(job: str) -> None:
    store = InMemoryWeightStore()
    keepers = {f"w{i}": LeaseKeeper(store, job, f"w{i}", 7, ttl_s=30.0) for i in range(3)}
    held: dict[str, set[int]] = {name: set() for name in keepers}
    settle(keepers, held)
    assert_fair(store, job, held, 7)

    keepers["w3"] = LeaseKeeper(store, job, "w3", 7, ttl_s=30.0)
    held["w3"] = set()
    settle(keepers, held)
    assert_fair(store, job, held, 7)  # now at most 2 each
    assert held["w3"], "the newcomer got no shard"

    leaving = keepers.pop("w0")
    for shard in held.pop("w0"):
        leaving.release(shard)
    leaving.leave()
    settle(keepers, held)
    assert_fair(store, job, held, 7)


def test_a_lease_taken_by_another_worker_is_reported_lost(job: str) -> None:
    now = [1000.0]
    store = InMemoryWeightStore(clock=lambda: now[0])
    first = LeaseKeeper(store, job, "first", 2, ttl_s=5.0)
    plan = first.plan(set())
    assert sorted(plan.acquired) == [0, 1]
    now[0] += 10  # first stalls past its TTL; second claims everything meanwhile
    second = LeaseKeeper(store, job, "second", 2, ttl_s=5.0)
    assert sorted(second.plan(set()).acquired) == [0, 1]
    assert sorted(first.plan({0, 1}).lost) == [0, 1]


def test_home_shards_spread_workers_over_the_shards() -> None:
    homes = {home_shard(f"worker-{i}", 16) for i in range(32)}
    assert len(homes) > 8  # not all racing for shard 0


def wait_until(condition: Callable[[], bool], timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.02)


def owners(store: Any, job: str, shards: int) -> list[str | None]:
    return [lease_owner(store, job, lease_name(s)) for s in range(shards)]


def serve_one_batch_per_shard(client: ScriptedClient, model: Any, seq: int) -> None:
    gen = torch.Generator().manual_seed(seq)
    for shard in range(4):
        client.batch(f"c{shard}", seq, *random_batch(model, gen), shard=shard)
    for shard in range(4):
        replies = client.drain_replies(f"c{shard}", 1)
        assert [r.seq for r in replies] == [seq], f"shard {shard} was not served"


def test_two_workers_split_four_shards_and_hand_over_on_stop(job: str) -> None:
    settings = make_settings(
        job, algorithm={"name": "sfl", "shards": 4}, clients={"count": 4},
        workers={"lease_ttl_s": 2.0},
    )  # fmt: skip
    embedded = Embedded()
    model = seed_version(embedded.store, settings)
    client = ScriptedClient(InMemoryBroker(embedded.hub), job, shards=4)
    client.declare([f"c{s}" for s in range(4)])
    for shard in range(4):  # admitted, as the coordinator would: workers refuse strangers
        embedded.store.heartbeat(job, member_id(f"c{shard}"), 600.0)
    backends = Backends(settings.broker, settings.store, embedded)
    stops = {name: threading.Event() for name in ("a", "b")}
    results: dict[str, Any] = {}

    def run(name: str) -> None:
        results[name] = Worker(settings, backends, worker_id=name).run(stops[name])

    threads = {name: threading.Thread(target=run, args=(name,)) for name in stops}
    try:
        for thread in threads.values():
            thread.start()
        wait_until(lambda: sorted(map(str, owners(embedded.store, job, 4))) == list("aabb"))
        serve_one_batch_per_shard(client, model, 0)

        stops["a"].set()
        threads["a"].join(timeout=30)
        assert not threads["a"].is_alive()
        wait_until(lambda: owners(embedded.store, job, 4) == ["b"] * 4)
        serve_one_batch_per_shard(client, model, 1)
    finally:
        for name, stop in stops.items():
            stop.set()
            threads[name].join(timeout=30)
    a, b = results["a"], results["b"]
    # Whatever "a" took (all four if it came first), it handed back, none was lost.
    assert a.shards_released == a.shards_acquired >= 2
    assert a.shards_lost == b.shards_lost == 0
    assert a.batches_applied == 2 and b.batches_applied == 6
    for shard in range(4):  # both batches of every shard are in its checkpoint
        checkpoint = embedded.store.load_checkpoint(job, shard)
        assert checkpoint is not None and checkpoint.applied == 2


class KindRecordingStore(InMemoryWeightStore):
    """Records the kind of each read of the live members."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[MemberKind | None] = []

    def live_members(self, job: str, kind: MemberKind | None = None) -> dict[str, Member]:
        self.reads.append(kind)
        return super().live_members(job, kind)


def test_a_plan_counts_the_workers_from_a_read_of_the_workers_only(job: str) -> None:
    store = KindRecordingStore()
    for i in range(50):  # clients and role records beside: none of them is a worker
        store.heartbeat(job, member_id(f"c{i}"), 60.0)
    store.heartbeat(job, "health:aggregator", 60.0)
    store.heartbeat(job, "worker:other", 60.0)
    plan = LeaseKeeper(store, job, "w1", 4, ttl_s=30.0).plan(set())
    assert (plan.workers, plan.target) == (2, 2)
    assert store.reads == [MemberKind.WORKER]
