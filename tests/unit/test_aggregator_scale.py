"""Cross-device rounds (issue 13): 2,000 members, 5 sampled a round, 40 replaced between rounds.

The aggregator's memory must not grow with the members that did not report: everything it
keeps per client, apart from the one list of the live members it reads per round, stays
bounded by the clients that reported lately and the members that left lately. And the members
are read once a round, not once a poll.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from broker.codec import decode, encode
from broker.messages import WeightsAssignment
from broker.store import SERVER_PART, BlobRef, WeightStore
from broker.topology import CONTROL_EXCHANGE, reply_queue_name, updates_routing_key
from services.aggregator.aggregator import Aggregator, ensure_initial_version
from services.aggregator.budget import SenderBudgets
from services.aggregator.core import Core
from services.algorithms.registry import build_strategy
from services.common.backends import Backends, Embedded
from services.common.membership import member_id
from services.report.records import ListSink, VersionRecord
from tests.unit.test_aggregator_peers import (
    WAIT_S,
    FakeClient,
    FakeWorker,
    ManualClock,
    add_member,
    declare_all,
    make_settings,
    running,
    worker_loop,
)

MEMBERS = 2000  # live at any time
UNREADY_EVERY = 40  # every 40th member (a 50th of them) has no training samples
PER_ROUND = 5
ROUNDS = 30
CHURN = 40  # members that leave between two rounds, and as many new ones that join
STEP_S = 3.0  # the clocks' advance between two rounds
DEADLINE_S = 15.0  # a member that left is remembered for twice this
LOG = logging.getLogger("test.aggregator.scale")


def ids(prefix: str, n: int) -> list[str]:
    return [f"{prefix}{i:04d}" for i in range(n)]


def join(store: WeightStore, job: str, client: str) -> None:
    unready = int(client[1:]) % UNREADY_EVERY == 0
    add_member(store, job, client, samples=0 if unready else 10)


def host_loop(
    backends: Backends, job: str, clients: list[str]
) -> Callable[[threading.Event], None]:
    """One thread for every client's reply queue: each assignment answered with an update."""

    def target(stop: threading.Event) -> None:
        broker = backends.open_broker("fake-host")
        try:
            for client in clients:
                broker.subscribe(reply_queue_name(job, client), prefetch=2)
            while not stop.is_set():
                delivery = broker.get(0.05)
                if delivery is None:
                    continue
                message = decode(delivery.body)
                broker.ack(delivery)
                if isinstance(message, WeightsAssignment) and message.participate:
                    update = FakeClient(message.client, 10, lambda r: 1.0).update(message)
                    broker.publish(CONTROL_EXCHANGE, updates_routing_key(job), encode(update))
        finally:
            broker.close()

    return target


def held_per_client(core: Core) -> dict[str, int]:
    """The length of every container the clock and its parts hold, but the live members read
    this round and the records (one per version)."""
    parts = {
        "core": core,
        "inbox": core.inbox,
        "book": core.members,
        "budgets": core.inbox.budgets,
        "surplus": core.inbox.surplus,
    }
    sizes = {}
    for name, part in parts.items():
        for attr, value in vars(part).items():
            if isinstance(value, dict | set | list) and attr not in ("live_now", "records"):
                sizes[f"{name}.{attr}"] = len(value)
    return sizes


class Churn(ListSink):
    """After each round: CHURN members leave, as many new ones join, the clocks move on, and
    what the aggregator holds is measured."""

    def __init__(
        self,
        store: WeightStore,
        job: str,
        clock: ManualClock,
        leaving: list[str],
        joining: list[str],
    ) -> None:
        super().__init__()
        self.store, self.job, self.clock = store, job, clock
        self.leaving, self.joining = iter(leaving), iter(joining)
        self.core: Core | None = None
        self.sizes: list[dict[str, int]] = []

    def record(self, record: VersionRecord) -> None:
        super().record(record)
        assert self.core is not None
        self.sizes.append(held_per_client(self.core))
        for _ in range(CHURN):
            self.store.remove_member(self.job, member_id(next(self.leaving)))
            join(self.store, self.job, next(self.joining))
        self.clock.advance(STEP_S)


def test_memory_stays_bounded_by_recent_reporters_with_thousands_of_members(job: str) -> None:
    settings = make_settings(
        job,
        job={"rounds": ROUNDS},
        clients={"count": MEMBERS, "min_to_start": 1, "per_round": PER_ROUND},
        rounds={"deadline_s": DEADLINE_S},
    )
    embedded = Embedded()
    backends = Backends(settings.broker, settings.store, embedded)
    store = embedded.store
    ensure_initial_version(store, settings, build_strategy(settings.algorithm.name), LOG)
    first, later = ids("m", MEMBERS), ids("n", CHURN * ROUNDS)
    for client in first:
        join(store, job, client)
    declare_all(backends, settings, first + later)
    clock = ManualClock()
    sink = Churn(store, job, clock, first + later, later)
    aggregator = Aggregator(settings, backends, sink=sink, clock=clock, pace=clock)
    broker = backends.open_broker("aggregator")
    worker = FakeWorker(store.read_blob(job, 1, BlobRef(SERVER_PART)), lambda r: 5.0)
    try:
        done = threading.Event()

        def aggregate(stop: threading.Event) -> None:
            core = sink.core = aggregator.core(broker, store, stop)
            core.run()
            done.set()

        peers = [host_loop(backends, job, first + later), worker_loop(backends, job, 1, worker)]
        with running([*peers, aggregate]):
            finished = done.wait(WAIT_S * 3)
    finally:
        broker.close()
    assert finished, "the aggregator did not finish the job"

    assert [r.participants for r in sink.records] == [PER_ROUND] * ROUNDS
    assert sink.core is not None
    book = sink.core.members
    # One read of the members a round (at its opening), however many polls the round took.
    assert book.reads == ROUNDS
    # A member that left is remembered for 2 * DEADLINE_S, i.e. over the last 11 rounds' churn.
    kept_rounds = int(2 * DEADLINE_S / STEP_S) + 1
    refill_rounds = int(SenderBudgets().burst / SenderBudgets().rate_per_s / STEP_S) + 2
    late = sink.sizes[kept_rounds:]
    assert max(s["book.departed"] for s in late) <= CHURN * kept_rounds
    assert max(s["budgets._buckets"] for s in late) <= PER_ROUND * refill_rounds
    # The members without samples that are live now: one in 40 of them, whoever left.
    assert max(s["core._unready"] for s in sink.sizes) == MEMBERS // UNREADY_EVERY
    # Nothing else the aggregator holds grows with the members: at most a cohort's worth.
    others = {
        k for k in late[-1] if k not in ("book.departed", "budgets._buckets", "core._unready")
    }
    assert max(s[k] for s in sink.sizes for k in others) <= PER_ROUND
