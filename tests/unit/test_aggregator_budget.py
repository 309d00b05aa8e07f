"""Per-sender budgets on the updates queue: a flooder's surplus is refused (dead-lettered in
batches, each with the reason), the others are served, strangers share one budget, and what a
round takes spends none (junk in a member's name cannot refuse its real update)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from broker.codec import encode
from broker.errors import BrokerError
from broker.memory_broker import InMemoryBroker, InMemoryHub
from broker.messages import ABORTED, RoundDropped, WeightsUpdate, new_message_id
from broker.topology import (
    CONTROL_EXCHANGE,
    dead_queue,
    dead_queue_name,
    reply_queue,
    updates_queue,
    updates_queue_name,
    updates_routing_key,
)
from broker.transport import REASON_HEADER, Broker, Delivery, Headers, PublishOptions, QueueSpec
from services.aggregator.budget import OVER_BUDGET, STRANGERS, SenderBudgets, Surplus
from services.aggregator.gate import MemberBook, UpdateScreen, reference_of
from services.aggregator.inbox import UpdateInbox
from services.aggregator.round_gate import OpenRound
from services.common.backends import Embedded
from services.common.handout import WeightsCache
from services.common.membership import MemberInfo, member_id
from services.common.outbox import Outbox
from services.metrics.broker import BrokerMeter
from services.metrics.prometheus import PrometheusMeters
from services.security.identity import SenderCheck, client_user, host_user
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


class BatchCounter(InMemoryBroker):
    """Counts the batches of dead letters and their sizes."""

    def __init__(self, hub: InMemoryHub) -> None:
        super().__init__(hub)
        self.batches: list[int] = []

    def dead_letter_many(
        self, letters: Sequence[tuple[Delivery, str]]
    ) -> list[tuple[Delivery, BrokerError]]:
        self.batches.append(len(letters))
        return super().dead_letter_many(letters)


@dataclass
class Flood:
    """A job with two members (honest, mallory), their queues, and an open round."""

    job: str
    embedded: Embedded
    gate: OpenRound
    weights: dict[str, torch.Tensor]

    @classmethod
    def of(cls, job: str) -> Flood:
        embedded = Embedded()
        seed_version(embedded.store, make_settings(job))
        for i, client in enumerate(("honest", "mallory")):
            info = MemberInfo(client, 0, CUT, 10, i).to_info()
            embedded.store.heartbeat(job, member_id(client), 60.0, info)
        InMemoryBroker(embedded.hub).declare(cls.specs(job))
        weights, aux = WeightsCache(embedded.store, job, 1).global_weights()
        cohort = {"honest": MemberInfo("honest", 0, CUT, 10, 0)}
        gate = OpenRound(0, 1, cohort, 0.0, 60.0, 1.0, reference_of(weights), reference_of(aux))
        return cls(job, embedded, gate, weights)

    @staticmethod
    def specs(job: str) -> list[QueueSpec]:
        return [dead_queue(job), updates_queue(job), reply_queue(job, "honest")]

    def update(self, client: str, **tensors: torch.Tensor) -> bytes:
        state = {**self.weights, **tensors}
        return encode(WeightsUpdate(self.job, client, new_message_id(), 1, 0, 10, state, {}))

    def junk(self) -> bytes:
        return self.update("mallory", not_in_the_model=torch.zeros(1))

    def publish(self, body: bytes, message_id: str, user: str | None = None) -> None:
        broker = InMemoryBroker(self.embedded.hub, stamp=user)
        broker.publish(
            CONTROL_EXCHANGE,
            updates_routing_key(self.job),
            body,
            PublishOptions(message_id=message_id),
        )

    def inbox(
        self,
        broker: Broker,
        budgets: SenderBudgets,
        surplus: Surplus | None = None,
        senders: SenderCheck | None = None,
    ) -> UpdateInbox:
        broker.declare(self.specs(self.job))
        broker.subscribe(updates_queue_name(self.job), prefetch=100)
        members = MemberBook(self.embedded.store, self.job)
        return UpdateInbox(
            broker,
            Outbox(broker, self.job, LOG),
            self.job,
            LOG,
            screen=UpdateScreen.of(self.embedded.store, self.job, 1, members, partial=False),
            budgets=budgets,
            surplus=Surplus() if surplus is None else surplus,
            senders=SenderCheck() if senders is None else senders,
        )

    def dead_letters(self) -> dict[str, Headers]:
        """The dead letters' headers by message id (taken off `<job>.dead`)."""
        broker = InMemoryBroker(self.embedded.hub)
        broker.subscribe(dead_queue_name(self.job), prefetch=1000)
        letters: dict[str, Headers] = {}
        while (delivery := broker.get(0.0)) is not None:
            letters[delivery.message_id or ""] = delivery.headers
            broker.ack(delivery)
        return letters


def test_a_flooders_surplus_is_refused_into_the_dead_letter_queue_with_its_reason(
    job: str,
) -> None:
    flood = Flood.of(job)
    for i in range(10):
        flood.publish(flood.junk(), f"junk-{i}")
    flood.publish(b"\x00", "anon-0")
    flood.publish(b"\x00", "anon-1")
    flood.publish(flood.update("honest"), "honest")
    broker = BatchCounter(flood.embedded.hub)
    inbox = flood.inbox(broker, SenderBudgets(burst=3, rate_per_s=1e-9))

    inbox.drain(flood.gate, 1)

    assert set(flood.gate.updates) == {"honest"}  # served after the flood ahead of it
    # mallory's first 3 dead-lettered with the screen's reason (one by one), 7 for its budget;
    # strangers (undecodable bodies) spend a budget of their own, judged while the
    # surplus waits: they join its batch.
    assert (inbox.stats.dead_lettered, inbox.stats.throttled) == (3 + 2, 7)
    assert inbox.refusals[OVER_BUDGET] == 7
    assert broker.batches == [7 + 2]
    letters = flood.dead_letters()
    assert set(letters) == {f"junk-{i}" for i in range(10)} | {"anon-0", "anon-1"}
    reasons = {m: str(h[REASON_HEADER]) for m, h in letters.items()}  # every one has a reason
    refused = sorted(m for m, r in reasons.items() if r.startswith("over_budget:"))
    assert refused == [f"junk-{i}" for i in range(3, 10)]
    assert reasons["junk-9"] == (
        "over_budget: sender 'mallory' above 3 messages then 1e-09/s that no round took; refused"
    )
    assert all("unknown tensors" in reasons[f"junk-{i}"] for i in range(3))
    assert all(reasons[f"anon-{i}"].startswith("undecodable") for i in range(2))
    assert STRANGERS == ""  # the strangers' budget is keyed by no client id
    assert "senders without an identity" in SenderBudgets().refusal(STRANGERS).detail


def test_junk_in_a_members_name_spends_its_budget_yet_its_real_update_is_taken(job: str) -> None:
    """Issue 33: 9,000 RoundDropped claiming client-2 (open mode: nothing says who sent them)
    spent client-2's budget, and its real update behind them was refused `over_budget`."""
    flood = Flood.of(job)
    for i in range(10):
        drop = RoundDropped(job, "honest", new_message_id(), 999, 0, ABORTED)
        flood.publish(encode(drop), f"forged-{i}")
    flood.publish(flood.update("honest"), "honest")
    inbox = flood.inbox(InMemoryBroker(flood.embedded.hub), SenderBudgets(3, 1e-9))

    inbox.drain(flood.gate, 1)

    assert set(flood.gate.updates) == {"honest"} and inbox.stats.accepted == 1
    assert flood.gate.declined == {}  # no forged drop was taken for the round's
    assert (inbox.stats.late, inbox.stats.throttled, inbox.stats.dead_lettered) == (0, 7, 3)
    reasons = {m: str(h[REASON_HEADER]) for m, h in flood.dead_letters().items()}
    assert set(reasons) == {f"forged-{i}" for i in range(10)}
    assert all("based on version 999" in reasons[f"forged-{i}"] for i in range(3))
    assert all(reasons[f"forged-{i}"].startswith("over_budget: sender 'honest'") for i in (3, 9))


def test_in_the_secured_mode_the_authenticated_sender_pays(job: str) -> None:
    """Junk that mallory's RabbitMQ user sends in honest's name is refused (`bad_sender`) and
    spends mallory's user's budget, never honest's: honest's late update is still answered."""
    flood = Flood.of(job)
    flood.gate.round, flood.gate.version = 1, 2  # round 1 closed: honest's update is late
    mallory, honest = client_user(job, "mallory"), client_user(job, "honest")
    for i in range(10):
        flood.publish(flood.update("honest"), f"forged-{i}", user=mallory)
    flood.publish(flood.update("honest"), "honest", user=honest)
    secured = SenderCheck(secured=True, job=job)
    inbox = flood.inbox(InMemoryBroker(flood.embedded.hub), SenderBudgets(3, 1e-9), None, secured)

    inbox.drain(flood.gate, 2)

    assert (inbox.stats.dead_lettered, inbox.stats.throttled, inbox.stats.late) == (3, 7, 1)
    reasons = {m: str(h[REASON_HEADER]) for m, h in flood.dead_letters().items()}
    assert set(reasons) == {f"forged-{i}" for i in range(10)}
    assert all("does not match the AMQP user" in reasons[f"forged-{i}"] for i in range(3))
    assert reasons["forged-9"].startswith(f"over_budget: sender '{mallory}'")


def test_a_client_hosts_updates_are_all_taken_whatever_its_users_budget(job: str) -> None:
    """A client host's clients share one RabbitMQ user, so their updates of a round spend one
    budget: before, the 4th of them (burst 3) was refused `over_budget`. What a round takes
    spends none."""
    flood = Flood.of(job)
    clients = [f"edge-{i}" for i in range(6)]
    for i, client in enumerate(clients):
        info = MemberInfo(client, 0, CUT, 10, 2 + i)
        flood.embedded.store.heartbeat(job, member_id(client), 60.0, info.to_info())
    flood.gate.cohort = {c: MemberInfo(c, 0, CUT, 10, 2 + i) for i, c in enumerate(clients)}
    for client in clients:
        flood.publish(flood.update(client), client, user=host_user(job, "edge"))
    secured = SenderCheck(secured=True, job=job)
    inbox = flood.inbox(InMemoryBroker(flood.embedded.hub), SenderBudgets(3, 1e-9), None, secured)

    inbox.drain(flood.gate, 1)

    assert set(flood.gate.updates) == set(clients)
    assert (inbox.stats.accepted, inbox.stats.throttled, inbox.stats.dead_lettered) == (6, 0, 0)


def test_the_surplus_goes_in_batches_full_aged_or_before_the_inbox_waits(job: str) -> None:
    flood = Flood.of(job)
    clock = ManualClock()
    broker = BatchCounter(flood.embedded.hub)
    surplus = Surplus(size=4, wait_s=0.01, clock=clock)
    inbox = flood.inbox(broker, SenderBudgets(burst=1, rate_per_s=1e-9), surplus=surplus)
    for i in range(10):
        flood.publish(flood.junk(), f"junk-{i}")

    for _ in range(6):  # one judged, then 5 refused: a batch of 4 is full
        assert inbox.poll(0.0, flood.gate, 1)
    assert broker.batches == [4] and len(surplus) == 1
    clock.advance(0.02)
    assert inbox.poll(0.0, flood.gate, 1)  # the oldest has waited long enough
    assert broker.batches == [4, 2] and len(surplus) == 0
    for _ in range(3):
        assert inbox.poll(0.0, flood.gate, 1)
    assert broker.batches == [4, 2] and len(surplus) == 3
    assert not inbox.poll(0.05, flood.gate, 1)  # nothing left: flushed before waiting
    assert broker.batches == [4, 2, 3] and len(surplus) == 0
    assert inbox.stats.throttled == 9
    letters = flood.dead_letters()
    assert len(letters) == 10 and all(REASON_HEADER in h for h in letters.values())


def test_the_surplus_counts_as_one_dead_letter_each_in_the_metrics(job: str) -> None:
    flood = Flood.of(job)
    meters = PrometheusMeters(job)
    meter = BrokerMeter(meters.role("aggregator", "a"))
    broker = InMemoryBroker(flood.embedded.hub, meter=meter)
    inbox = flood.inbox(broker, SenderBudgets(burst=1, rate_per_s=1e-9))
    for i in range(6):
        flood.publish(flood.junk(), f"junk-{i}")

    inbox.drain(flood.gate, 1)

    labels = {"splitmq_job": job, "role": "aggregator", "member": "a"}
    name = "splitmq_dead_lettered_total"
    assert meters.registry.get_sample_value(name, {**labels, "reason": "over_budget"}) == 5
