"""Per-sender budgets on the updates queue: a flooder's surplus is refused unjudged (nacked into
`<job>.dead`), the others are served, and strangers share one budget."""

from __future__ import annotations

import logging

import torch

from broker.codec import encode
from broker.memory_broker import InMemoryBroker
from broker.messages import WeightsUpdate, new_message_id
from broker.topology import (
    CONTROL_EXCHANGE,
    dead_queue,
    dead_queue_name,
    reply_queue,
    updates_queue,
    updates_queue_name,
    updates_routing_key,
)
from broker.transport import REASON_HEADER, Headers
from services.aggregator.budget import STRANGERS, SenderBudgets
from services.aggregator.gate import OpenRound, reference_of
from services.aggregator.inbox import OVER_BUDGET, UpdateInbox
from services.aggregator.members import MemberBook
from services.aggregator.screen import UpdateScreen
from services.coordinator.handout import WeightsCache
from services.coordinator.membership import MemberInfo, member_id
from services.coordinator.outbox import Outbox
from services.runtime.backends import Embedded
from tests.unit.test_aggregator_peers import ManualClock
from tests.unit.test_worker_support import CUT, make_settings, seed_version

LOG = logging.getLogger("test.budget")


def test_a_bucket_allows_its_burst_then_its_rate() -> None:
    clock = ManualClock()
    budgets = SenderBudgets(burst=3, rate_per_s=2.0, clock=clock)
    assert [budgets.spend("m") for _ in range(4)] == [True, True, True, False]
    assert budgets.spend("a")  # another sender's bucket is its own
    clock.advance(0.5)  # one message's worth back
    assert [budgets.spend("m") for _ in range(2)] == [True, False]
    assert budgets.report("m") == 2 and budgets.report("m") == 0  # at most once a second
    assert not budgets.spend("m")  # nothing back yet
    assert budgets.report("m") == 0  # reported less than a second ago
    clock.advance(1.0)
    assert budgets.report("m") == 1
    clock.advance(100.0)
    assert [budgets.spend("m") for _ in range(4)] == [True, True, True, False]  # capped


def test_a_flooders_surplus_is_nacked_into_the_dead_letter_queue_unjudged(job: str) -> None:
    settings = make_settings(job)
    embedded = Embedded()
    seed_version(embedded.store, settings)
    for i, client in enumerate(("honest", "mallory")):
        info = MemberInfo(client, 0, CUT, 10, i).to_info()
        embedded.store.heartbeat(job, member_id(client), 60.0, info)
    broker = InMemoryBroker(embedded.hub)
    specs = [dead_queue(job), updates_queue(job), reply_queue(job, "honest")]
    broker.declare(specs)
    weights, aux = WeightsCache(embedded.store, job, 1).global_weights()
    cohort = {"honest": MemberInfo("honest", 0, CUT, 10, 0)}
    gate = OpenRound(0, 1, cohort, 0.0, 60.0, 1.0, reference_of(weights), reference_of(aux))

    def update(client: str, **tensors: torch.Tensor) -> bytes:
        state = {**weights, **tensors}
        return encode(WeightsUpdate(job, client, new_message_id(), 1, 0, 10, state, {}))

    key = updates_routing_key(job)
    junk = update("mallory", not_in_the_model=torch.zeros(1))
    for i in range(10):
        broker.publish(CONTROL_EXCHANGE, key, junk, message_id=f"junk-{i}")
    broker.publish(CONTROL_EXCHANGE, key, b"\x00", message_id="anon-0")
    broker.publish(CONTROL_EXCHANGE, key, b"\x00", message_id="anon-1")
    broker.publish(CONTROL_EXCHANGE, key, update("honest"), message_id="honest")

    handle = InMemoryBroker(embedded.hub)
    handle.declare(specs)
    handle.subscribe(updates_queue_name(job), prefetch=100)
    members = MemberBook(embedded.store, job)
    inbox = UpdateInbox(
        handle,
        Outbox(handle, job, LOG),
        job,
        LOG,
        screen=UpdateScreen.of(embedded.store, job, 1, members, partial=False),
        budgets=SenderBudgets(burst=3, rate_per_s=1e-9),
    )
    inbox.drain(gate, 1)

    assert set(gate.updates) == {"honest"}  # served after the flood ahead of it
    # mallory's first 3 judged (dead-lettered with the screen's reason), 7 refused unjudged;
    # strangers (undecodable bodies) spend a budget of their own.
    assert (inbox.stats.dead_lettered, inbox.stats.throttled) == (3 + 2, 7)
    assert inbox.refusals[OVER_BUDGET] == 7
    letters: dict[str, Headers] = {}
    handle.subscribe(dead_queue_name(job), prefetch=100)
    while (delivery := handle.get(0.0)) is not None:
        letters[delivery.message_id or ""] = delivery.headers
        handle.ack(delivery)
    assert set(letters) == {f"junk-{i}" for i in range(10)} | {"anon-0", "anon-1"}
    judged = [m for m, h in letters.items() if REASON_HEADER in h]
    assert sorted(judged) == ["anon-0", "anon-1", "junk-0", "junk-1", "junk-2"]
    assert all("unknown tensors" in str(letters[m][REASON_HEADER]) for m in judged if "junk" in m)
    refused = [h for m, h in letters.items() if m not in judged]
    assert all(h.get("x-first-death-reason") == "rejected" for h in refused), refused[:1]
    assert STRANGERS == ""  # the strangers' budget is keyed by no client id
