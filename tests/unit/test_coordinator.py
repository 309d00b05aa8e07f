"""The coordinator over the in-memory hub and store, with the test playing the clients."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch

from broker.codec import decode, encode
from broker.memory_broker import InMemoryBroker
from broker.memory_store import InMemoryWeightStore
from broker.messages import (
    Error,
    Event,
    Heartbeat,
    Join,
    Leave,
    Message,
    Welcome,
    new_message_id,
)
from broker.store import AUX_PART, CLIENT_PART, BlobRef
from broker.topology import (
    CONTROL_EXCHANGE,
    dead_queue_name,
    events_queue,
    reply_queue,
    reply_queue_name,
)
from broker.transport import REASON_HEADER, Broker, PublishOptions
from services.aggregator.aggregator import ensure_initial_version
from services.algorithms.registry import build_strategy
from services.common.backends import Backends, Embedded
from services.common.membership import MemberInfo, client_members, member_id
from services.config.root import Settings
from services.coordinator.coordinator import Coordinator
from services.coordinator.welcomes import REWELCOME_S
from tests.unit.test_aggregator_peers import WAIT_S, ManualClock, make_settings, running

LOG = logging.getLogger("test.coordinator")


class Desk:
    """A coordinator under test, and handles for the clients the test plays."""

    def __init__(
        self,
        settings: Settings,
        *,
        store: InMemoryWeightStore | None = None,
        publish_version_1: bool = True,
    ) -> None:
        self.settings = settings
        self.job = settings.job.name
        self.embedded = Embedded() if store is None else Embedded(store=store)
        self.store = self.embedded.store
        self.backends = Backends(settings.broker, settings.store, self.embedded)
        self.clock = ManualClock()
        self.coordinator = Coordinator(settings, self.backends, clock=self.clock, poll_s=0.02)
        if publish_version_1:
            self.publish_version_1()
        self.events = InMemoryBroker(self.embedded.hub)
        self.events.declare([events_queue(self.job, "test")])
        self.events.subscribe(events_queue(self.job, "test").name, prefetch=100)
        self.handles: dict[str, Broker] = {}

    def publish_version_1(self) -> None:
        strategy = build_strategy(self.settings.algorithm.name)
        ensure_initial_version(self.store, self.settings, strategy, LOG)

    def handle(self, client: str, *, user: str | None = None) -> Broker:
        if client not in self.handles:
            broker = InMemoryBroker(self.embedded.hub, user=user)
            broker.declare([reply_queue(self.job, client)])
            broker.subscribe(reply_queue_name(self.job, client), prefetch=10)
            self.handles[client] = broker
        return self.handles[client]

    def send(self, message: Message, *, as_client: str | None = None) -> None:
        client = as_client or message.client
        self.handle(client).publish(CONTROL_EXCHANGE, self.job, encode(message))

    def join(self, client: str, *, samples: int = 50, **info: str) -> Join:
        message = Join(self.job, client, new_message_id(), 0, samples, 0, info)
        self.send(message)
        return message

    def reply(self, client: str, timeout: float = WAIT_S) -> Message | None:
        delivery = self.handle(client).get(timeout)
        if delivery is None:
            return None
        self.handle(client).ack(delivery)
        return decode(delivery.body)

    def welcome(self, client: str) -> Welcome:
        message = self.reply(client)
        assert isinstance(message, Welcome), message
        return message

    def event(self) -> Event:
        delivery = self.events.get(WAIT_S)
        assert delivery is not None, "no event"
        self.events.ack(delivery)
        message = decode(delivery.body)
        assert isinstance(message, Event)
        return message

    def member(self, client: str) -> MemberInfo:
        return client_members(self.store, self.job)[client]

    @contextmanager
    def serving(self) -> Iterator[threading.Event]:
        with running([self.coordinator.run]) as stop:
            yield stop


def settings_for(job: str, **sections: Mapping[str, Any]) -> Settings:
    clients = {"count": 3, "min_to_start": 1, **sections.pop("clients", {})}
    return make_settings(job, clients=clients, **sections)


def test_join_is_welcomed_with_the_current_weights_and_config(job: str) -> None:
    desk = Desk(settings_for(job, algorithm={"batch_size": 16, "lr": 0.05}))
    with desk.serving():
        join = desk.join("a", samples=120, index="1", classes="5,2")
        welcome = desk.welcome("a")
        event = desk.event()

    assert (welcome.shard, welcome.cut, welcome.version, welcome.round) == (0, "block1", 1, 0)
    assert welcome.config == {
        "algorithm": "sfl_v2",
        "batch_size": 16,
        "lr": 0.05,
        "momentum": 0.0,
        "server_lr": 0.05,
        "local_epochs": 1,
        "max_steps_per_round": 0,
        "smashed_dtype": "float32",
        "partition": 1,
        "shards": 1,
        # The training recipe travels whole, so the service's word wins (docs/training.md).
        "optimizer": '{"name":"","server":null}',
        "schedule": '{"name":"","every":"round","server":null}',
        "loss": '{"name":"cross_entropy"}',
    }
    expected = desk.store.read_blob(job, 1, BlobRef(CLIENT_PART))
    assert set(welcome.client_weights) == set(expected)
    assert all(torch.equal(welcome.client_weights[n], expected[n]) for n in expected)
    # SFL-V2 trains no auxiliary head: version 1 holds none and the Welcome carries none.
    assert BlobRef(AUX_PART) not in desk.store.manifest(job, 1).entries
    assert dict(welcome.aux_weights) == {}
    member = desk.member("a")
    assert (member.shard, member.partition, member.samples, member.classes) == (0, 1, 120, (2, 5))
    assert (event.kind, event.client, event.data["partition"]) == ("member_joined", "a", 1)
    assert join.message_id != welcome.message_id
    assert desk.coordinator.stats.joined == 1


def test_a_rejoin_gets_the_same_assignment(job: str) -> None:
    desk = Desk(settings_for(job, algorithm={"name": "sfl", "shards": 2}))
    with desk.serving():
        desk.join("a", index="2")
        first = desk.welcome("a")
        desk.join("b")
        desk.welcome("b")
        desk.clock.advance(REWELCOME_S)  # a Welcome again only after the interval
        desk.join("a", index="0", classes="1")  # asks for another slot: keeps its own
        again = desk.welcome("a")

    assert (again.shard, again.config["partition"]) == (first.shard, first.config["partition"])
    assert again.config["partition"] == 2
    assert set(client_members(desk.store, job)) == {"a", "b"}
    assert desk.member("a").classes == (1,)
    stats = desk.coordinator.stats
    assert (stats.joined, stats.rejoined) == (2, 1)


def test_a_join_from_another_process_is_recorded_as_a_new_incarnation(job: str) -> None:
    """The member record's session: the aggregator drops a member from its open round when
    the session changes (a restart, or a leave and a rejoin, between two of its reads)."""
    desk = Desk(settings_for(job))
    with desk.serving():
        records = []
        for session in ("p1", "p1", "p2"):  # p1 again: its Welcome was lost, say
            desk.join("a", index="1", session=session)
            desk.welcome("a")
            records.append(desk.member("a"))
            desk.clock.advance(REWELCOME_S)  # welcomed again only after the interval
        for _ in range(2):  # a client that names no session
            desk.join("b")
            desk.welcome("b")
            records.append(desk.member("b"))
            desk.clock.advance(REWELCOME_S)
        desk.send(Leave(job, "b", new_message_id(), 1, "stopped"))
        desk.join("b")  # handled after the Leave: one queue, in order
        desk.welcome("b")
        records.append(desk.member("b"))

    first, again, restarted, b1, b2, b3 = records
    assert first.session == again.session == "p1"
    assert restarted.session == "p2"  # a new process, the same assignment
    assert (restarted.shard, restarted.partition) == (first.shard, first.partition) == (0, 1)
    assert b1.session and b2.session == b1.session  # minted once, kept while it lives
    assert b3.session not in ("", b1.session)
    assert (desk.coordinator.stats.joined, desk.coordinator.stats.rejoined) == (3, 3)


def test_shards_are_balanced_over_live_members(job: str) -> None:
    desk = Desk(settings_for(job, algorithm={"name": "sfl", "shards": 2}, clients={"count": 4}))
    with desk.serving():
        shards = []
        for client in "abcd":
            desk.join(client)
            shards.append(desk.welcome(client).shard)
        desk.send(Leave(job, "b", new_message_id(), 1, "bye"))
        desk.join("e")
        e = desk.welcome("e")

    assert shards == [0, 1, 0, 1]
    assert (e.shard, e.config["partition"]) == (1, 1)  # b's shard and b's freed partition


def test_sfl_v1_gives_each_partition_its_own_shard(job: str) -> None:
    desk = Desk(settings_for(job, algorithm={"name": "sfl_v1"}))
    with desk.serving():
        desk.join("c", index="2")
        desk.join("a")
        desk.join("b", index="0")  # taken by a: gets the lowest free one
        got = {c: desk.welcome(c) for c in "cab"}

    assert {c: (w.shard, w.config["partition"]) for c, w in got.items()} == {
        "c": (2, 2),
        "a": (0, 0),
        "b": (1, 1),
    }
    assert all(w.config["shards"] == 3 for w in got.values())


def test_a_full_job_refuses_with_an_error(job: str) -> None:
    desk = Desk(settings_for(job, clients={"count": 2}))
    with desk.serving():
        for client in "ab":
            desk.join(client)
            desk.welcome(client)
        join = desk.join("c")
        refusal = desk.reply("c")

    assert isinstance(refusal, Error)
    assert refusal.code == "job_full" and "job full" in refusal.reason
    assert refusal.ref_message_id == join.message_id
    assert set(client_members(desk.store, job)) == {"a", "b"}
    assert desk.coordinator.stats.refused == 1


def test_heartbeats_keep_a_member_and_expiry_removes_it(job: str) -> None:
    store_clock = ManualClock()
    desk = Desk(
        settings_for(job, clients={"heartbeat_ttl_s": 10.0}),
        store=InMemoryWeightStore(clock=store_clock),
    )
    with desk.serving():
        desk.join("a")
        desk.welcome("a")
        assert desk.event().kind == "member_joined"
        store_clock.advance(8.0)
        desk.send(Heartbeat(job, "a", new_message_id(), 1))
        desk.send(Heartbeat(job, "zed", new_message_id(), 1), as_client="zed")
        unknown = desk.reply("zed")
        # The heartbeat was handled before zed's (one queue, in order): a lives 10 s from now.
        expires = desk.store.live_members(job)[member_id("a")].expires_at
        assert expires == store_clock() + 10.0
        store_clock.advance(10.5)
        assert "a" not in client_members(desk.store, job)
        desk.clock.advance(60.0)  # the coordinator's next sweep notices and announces it
        left = desk.event()
        desk.send(Heartbeat(job, "a", new_message_id(), 1))
        refused = desk.reply("a")

    assert isinstance(unknown, Error) and unknown.code == "unknown_member"
    assert (left.kind, left.client, left.data["reason"]) == ("member_left", "a", "expired")
    assert isinstance(refused, Error) and refused.reason == "unknown member, join first"
    stats = desk.coordinator.stats
    assert (stats.heartbeats, stats.unknown_heartbeats, stats.expired) == (1, 2, 1)


def test_leave_removes_the_member(job: str) -> None:
    desk = Desk(settings_for(job))
    with desk.serving():
        desk.join("a")
        desk.welcome("a")
        desk.event()
        desk.send(Leave(job, "a", new_message_id(), 1, "done"))
        left = desk.event()

    assert (left.kind, left.client, left.data["reason"]) == ("member_left", "a", "done")
    assert client_members(desk.store, job) == {}
    assert desk.coordinator.stats.left == 1


def test_bad_control_messages_are_dead_lettered_and_serving_goes_on(job: str) -> None:
    desk = Desk(settings_for(job))
    mallory = InMemoryBroker(desk.embedded.hub, user="mallory")
    with desk.serving():
        broker = desk.handle("a")
        broker.publish(CONTROL_EXCHANGE, job, b"\x01not a message")
        foreign = Join("other", "a", new_message_id(), 0, 10)
        broker.publish(CONTROL_EXCHANGE, job, encode(foreign))
        stray = Error(job, "a", new_message_id(), 0, "x", "wrong queue")
        broker.publish(CONTROL_EXCHANGE, job, encode(stray))
        impostor = Join(job, "a", new_message_id(), 0, 10)
        mallory.publish(CONTROL_EXCHANGE, job, encode(impostor), PublishOptions(user_id="mallory"))
        desk.join("a")
        welcome = desk.welcome("a")
        ghost = Join(job, "ghost", new_message_id(), 0, 10)
        desk.send(ghost, as_client="a")  # ghost has no reply queue: it cannot be answered
        desk.join("b")
        desk.welcome("b")

    reader = InMemoryBroker(desk.embedded.hub)
    reader.subscribe(dead_queue_name(job), prefetch=10)
    reasons = []
    while (delivery := reader.get(0.0)) is not None:
        reasons.append(str(delivery.headers[REASON_HEADER]))
    assert welcome.version == 1
    assert reasons[0].startswith("undecodable")
    assert "'other'" in reasons[1]
    assert "Error does not belong" in reasons[2]
    assert "mallory" in reasons[3]
    assert "ghost" in reasons[4] and "no reply queue" in reasons[4]
    assert len(reasons) == 5 == desk.coordinator.stats.dead_lettered
    assert set(client_members(desk.store, job)) == {"a", "b"}


def test_joins_wait_for_version_1(job: str) -> None:
    desk = Desk(settings_for(job), publish_version_1=False)
    with desk.serving():
        desk.join("a")
        assert desk.reply("a", timeout=0.3) is None  # no version yet: no Welcome
        desk.publish_version_1()
        welcome = desk.welcome("a")
    assert welcome.version == 1
