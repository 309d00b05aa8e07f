"""The interval between a client's Welcomes counts from when the Welcome was sent, not from
when the send returned: the client may hold it before then (a publisher confirm comes after the
delivery), and a client that asks again `REWELCOME_S` after its Welcome is welcomed again.
Before, a re-Join `REWELCOME_S` after the Welcome came was withheld when the send was slow
(tests/integration/test_coordinator_rabbitmq.py failed so under load)."""

from __future__ import annotations

import logging

from broker.memory_broker import InMemoryBroker, InMemoryHub
from broker.memory_store import InMemoryWeightStore
from broker.messages import Join, Message, new_message_id
from broker.topology import reply_queue
from services.aggregator.aggregator import ensure_initial_version
from services.algorithms.registry import build_strategy
from services.common.outbox import Outbox
from services.coordinator.joining import JoinDesk
from services.coordinator.roster import Roster
from services.coordinator.welcomes import REWELCOME_S, WelcomeLimit
from tests.unit.test_aggregator_peers import ManualClock
from tests.unit.test_coordinator import settings_for

LOG = logging.getLogger("test.coordinator")
SEND_S = 0.5  # how long the coordinator's send of a Welcome takes after its delivery


class SlowOutbox(Outbox):
    """Delivers at once (the client may read it), returns `SEND_S` later on the clock."""

    def __init__(self, broker: InMemoryBroker, job: str, clock: ManualClock) -> None:
        super().__init__(broker, job, LOG)
        self._clock = clock

    def reply(self, client: str, message: Message) -> int:
        size = super().reply(client, message)
        self._clock.advance(SEND_S)
        return size


def test_a_rejoin_the_interval_after_the_welcome_came_is_welcomed(job: str) -> None:
    settings = settings_for(job)
    store = InMemoryWeightStore()
    ensure_initial_version(store, settings, build_strategy(settings.algorithm.name), LOG)
    broker = InMemoryBroker(InMemoryHub())
    broker.declare([reply_queue(job, "a")])
    clock = ManualClock()
    outbox = SlowOutbox(broker, job, clock)
    roster = Roster(store, job, count=3, ttl_s=60.0, expired=lambda _: None, clock=clock)
    desk = JoinDesk(settings, store, roster, outbox, LOG, WelcomeLimit(clock))

    def join() -> str:
        return desk.join(Join(job, "a", new_message_id(), 0, 50, 0, {"index": "1"}))

    first = join()
    # The client, holding its Welcome since it was delivered, waits the interval and asks again.
    clock.advance(REWELCOME_S - SEND_S)
    again = join()
    # Within the interval of that second Welcome: recorded, not welcomed again.
    soon = join()

    assert (first, again, soon) == ("new", "rejoined", "withheld")
