"""Joins through a client host and HostHeartbeats at the coordinator (docs/architecture.md,
"Client hosts"), over the in-memory hub and store, with the test playing the host."""

from __future__ import annotations

import pytest

from broker.codec import decode, encode
from broker.errors import UnroutableError
from broker.memory_broker import InMemoryBroker
from broker.memory_store import InMemoryWeightStore
from broker.messages import Error, HostHeartbeat, Join, Message, Welcome, new_message_id
from broker.topology import (
    CONTROL_EXCHANGE,
    REPLIES_EXCHANGE,
    dead_queue_name,
    host_queue_name,
    reply_routing_key,
)
from broker.transport import REASON_HEADER, PublishOptions
from services.common.membership import client_members, member_id
from services.coordinator.welcomes import REWELCOME_S
from services.security.hidden import host_reply_queue
from services.security.identity import host_user
from tests.unit.test_aggregator_peers import WAIT_S, ManualClock
from tests.unit.test_coordinator import Desk, settings_for


class Host:
    """The test's client host `host`: one handle reading the host's queue."""

    def __init__(self, desk: Desk, host: str, *, user: str | None = None, secret: str = "") -> None:
        self.desk, self.host, self.job = desk, host, desk.job
        self.user = user
        self.broker = InMemoryBroker(desk.embedded.hub, user=user, stamp=user)
        self.queue = host_reply_queue(self.job, host, secret).name
        self.broker.declare([host_reply_queue(self.job, host, secret)])
        self.broker.subscribe(self.queue, prefetch=100)

    def send(self, message: Message) -> None:
        self.broker.publish(CONTROL_EXCHANGE, self.job, encode(message))

    def join(self, client: str, *, host: str | None = None, queue: str | None = None) -> Join:
        info = {"host": host or self.host, "host_queue": queue or self.queue}
        message = Join(self.job, client, new_message_id(), 0, 50, 0, info)
        self.send(message)
        return message

    def beat(self, *clients: str, host: str | None = None) -> HostHeartbeat:
        members = dict.fromkeys(clients, 1)
        message = HostHeartbeat(self.job, host or self.host, new_message_id(), 1, members)
        self.send(message)
        return message

    def replies(self, count: int) -> list[Message]:
        found: list[Message] = []
        for _ in range(count):
            delivery = self.broker.get(WAIT_S)
            assert delivery is not None, f"{len(found)} of {count} replies"
            self.broker.ack(delivery)
            found.append(decode(delivery.body))
        return found

    def nothing_more(self) -> bool:
        return self.broker.get(0.2) is None


def dead_reasons(desk: Desk) -> list[str]:
    reader = InMemoryBroker(desk.embedded.hub)
    reader.subscribe(dead_queue_name(desk.job), prefetch=100)
    reasons = []
    while (delivery := reader.get(0.0)) is not None:
        reasons.append(str(delivery.headers[REASON_HEADER]))
    return reasons


def test_joins_through_a_host_are_answered_on_the_hosts_queue(job: str) -> None:
    desk = Desk(settings_for(job))
    edge = Host(desk, "edge")
    with desk.serving():
        edge.join("edge-0")
        edge.join("edge-1")
        welcomes = edge.replies(2)
        desk.join("solo")  # a standalone client beside the host
        solo = desk.welcome("solo")

    assert [(type(w), w.client) for w in welcomes] == [(Welcome, "edge-0"), (Welcome, "edge-1")]
    assert solo.client == "solo" and edge.nothing_more()
    assert set(client_members(desk.store, job)) == {"edge-0", "edge-1", "solo"}
    assert desk.coordinator.stats.joined == 3 and dead_reasons(desk) == []


def test_a_host_heartbeat_renews_each_member_and_tells_the_unknown_ones(job: str) -> None:
    store_clock = ManualClock()
    desk = Desk(
        settings_for(job, clients={"heartbeat_ttl_s": 10.0}),
        store=InMemoryWeightStore(clock=store_clock),
    )
    edge = Host(desk, "edge")
    with desk.serving():
        edge.join("edge-0")
        edge.join("edge-1")
        edge.replies(2)
        for _ in range(3):  # 24 s of heartbeats every 8 s: a TTL of 10 s holds
            store_clock.advance(8.0)
            edge.beat("edge-0", "edge-1")
            # One queue, in order: the join below is handled after the heartbeat.
            desk.clock.advance(REWELCOME_S)  # welcomed again only after the interval
            edge.join("edge-0")
            edge.replies(1)
        assert set(client_members(desk.store, job)) == {"edge-0", "edge-1"}
        expires = desk.store.live_members(job)[member_id("edge-1")].expires_at
        assert expires == store_clock() + 10.0
        store_clock.advance(11.0)
        edge.beat("edge-1", "edge-7")  # edge-1 expired; edge-7 never joined (no route)
        told = edge.replies(1)
        edge.join("edge-1")
        back = edge.replies(1)

    assert isinstance(told[0], Error) and told[0].client == "edge-1"
    assert told[0].code == "unknown_member"
    assert isinstance(back[0], Welcome) and back[0].client == "edge-1"
    stats = desk.coordinator.stats
    assert (stats.host_heartbeats, stats.host_members, stats.unknown_heartbeats) == (4, 6, 2)
    assert stats.expired == 1 and stats.dead_lettered == 0  # edge-1, announced when found gone


def test_a_host_speaks_only_for_its_own_clients(job: str) -> None:
    store_clock = ManualClock()
    desk = Desk(settings_for(job), store=InMemoryWeightStore(clock=store_clock))
    edge = Host(desk, "edge")
    with desk.serving():
        edge.join("edge-0")
        edge.replies(1)
        before = desk.store.live_members(job)[member_id("edge-0")].expires_at
        store_clock.advance(5.0)
        edge.join("core-0")  # routed to edge: the Join names edge as its host
        edge.join("edge-1", host="bad.host")
        edge.beat("edge-0", "core-0")  # one stranger: nobody is renewed
        edge.beat(*(f"edge-{i}" for i in range(1025)))
        edge.beat("edge-0", host="a.b")
        edge.join("edge-2")
        edge.replies(1)  # handled after all of the above

    reasons = dead_reasons(desk)
    assert "Join of client 'core-0' through host 'edge': a host's clients are edge-<n>" in reasons
    assert "through a bad host" in reasons[1]
    assert "lists 1 clients not its own (edge-<n>), e.g. 'core-0'" in reasons[2]
    assert "lists 1025 members; at most 1024" in reasons[3]
    assert "host id 'a.b'" in reasons[4]
    assert len(reasons) == 5 == desk.coordinator.stats.dead_lettered
    assert desk.store.live_members(job)[member_id("edge-0")].expires_at == before
    assert set(client_members(desk.store, job)) == {"edge-0", "edge-2"}
    with pytest.raises(UnroutableError):  # nothing bound core-0's replies anywhere
        edge.broker.publish(REPLIES_EXCHANGE, reply_routing_key(job, "core-0"), b"x")


def test_a_secured_host_user_speaks_for_its_clients_only(job: str) -> None:
    desk = Desk(settings_for(job, security={"per_client_users": True}))
    edge = Host(desk, "edge", user=host_user(job, "edge"))
    core = Host(desk, "core", user=host_user(job, "core"))
    with desk.serving():
        edge.join("core-0", host="core")  # edge's user claims core's client
        edge.beat("core-0", host="core")
        anonymous = Join(job, "edge-3", new_message_id(), 0, 50, 0, {"host": "edge"})
        edge.broker.stamp = None
        edge.send(anonymous)
        edge.broker.stamp = edge.user
        edge.join("edge-0")
        welcome = edge.replies(1)
        edge.beat("edge-0")
        desk.clock.advance(REWELCOME_S)  # welcomed again only after the interval
        edge.join("edge-0")  # answered after the heartbeat is handled: one queue, in order
        welcome += edge.replies(1)

    assert all(isinstance(w, Welcome) and w.client == "edge-0" for w in welcome)
    reasons = dead_reasons(desk)
    user = host_user(job, "edge")
    assert reasons == [
        f"client 'core-0' does not match the AMQP user {user!r}",
        f"host 'core' does not match the AMQP user {user!r}",
        "no AMQP user_id on a message of client 'edge-3': the secured mode "
        "(security.per_client_users) requires one",
    ]
    assert core.nothing_more() and edge.nothing_more()
    assert set(client_members(desk.store, job)) == {"edge-0"}
    assert desk.coordinator.stats.host_members == 1
    with pytest.raises(UnroutableError):
        desk.handle("x").publish(
            REPLIES_EXCHANGE, reply_routing_key(job, "core-0"), b"x", PublishOptions()
        )


def test_a_join_binds_only_to_an_existing_queue_of_its_host(job: str) -> None:
    """A hidden host queue gets its clients' replies; a Join naming a queue of the right shape
    that does not exist is dead-lettered, and the coordinator creates no queue for it."""
    desk = Desk(settings_for(job))
    edge = Host(desk, "edge", secret="edge's password")
    missing = host_queue_name(job, "edge", "0" * 32)
    with desk.serving():
        edge.join("edge-1", queue=missing)
        edge.join("edge-1", queue=host_queue_name(job, "edge"))  # the default: none here
        edge.join("edge-0")
        welcome = edge.replies(1)

    assert edge.queue.startswith(f"{host_queue_name(job, 'edge')}.")
    assert isinstance(welcome[0], Welcome) and welcome[0].client == "edge-0"
    assert dead_reasons(desk) == [
        f"cannot bind client 'edge-1''s replies to host 'edge': its queue {missing!r} does "
        "not exist",
        f"cannot bind client 'edge-1''s replies to host 'edge': its queue "
        f"{host_queue_name(job, 'edge')!r} does not exist",
    ]
    hub = desk.embedded.hub.queues
    assert missing not in hub and host_queue_name(job, "edge") not in hub
    assert set(client_members(desk.store, job)) == {"edge-0"}
    with pytest.raises(UnroutableError):  # nothing bound edge-1's replies anywhere
        edge.broker.publish(REPLIES_EXCHANGE, reply_routing_key(job, "edge-1"), b"x")
