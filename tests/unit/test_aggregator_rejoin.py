"""A cohort member that leaves and joins again (or is killed and restarted) while its round is
open, between two of the aggregator's reads of the members: the round must not wait for the
old process's update until the deadline (the new process never saw the assignment).

The real coordinator admits the clients and handles the Leave and the second Join; the
aggregator's clock only moves when the test says, by 2 s of a 60 s deadline, so only the
rejoin seen as a new process can close the round. Over the in-memory hub and store, and over
RabbitMQ and Redis.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from broker.codec import encode
from broker.messages import Join, Leave, Message, WeightsAssignment, Welcome, new_message_id
from broker.store import SERVER_PART, BlobRef
from broker.topology import CONTROL_EXCHANGE
from services.aggregator.aggregator import Aggregator, ensure_initial_version
from services.algorithms.registry import build_strategy
from services.common.backends import Backends, Embedded
from services.common.membership import client_members
from services.config.root import Settings
from services.coordinator.coordinator import Coordinator
from services.coordinator.welcomes import REWELCOME_S
from services.report.records import ListSink, VersionRecord
from tests.unit.test_aggregator_peers import (
    WAIT_S,
    FakeClient,
    FakeWorker,
    ManualClock,
    client_loop,
    declare_all,
    delete_all,
    make_settings,
    running,
    worker_loop,
)

LOG = logging.getLogger("test.aggregator.rejoin")
SAMPLES = {"a": 100, "b": 200, "c": 300}
DEADLINE_S = 60.0


def wait_until(predicate: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


@pytest.fixture(
    params=[
        "memory",
        pytest.param("rabbitmq+redis", marks=[pytest.mark.rabbitmq, pytest.mark.redis]),
    ]
)
def backends(request: pytest.FixtureRequest, job: str) -> Iterator[tuple[Settings, Backends]]:
    sections: dict[str, dict[str, object]] = {}
    if request.param != "memory":
        amqp_url = request.getfixturevalue("amqp_url")
        redis_url = request.getfixturevalue("redis_url")
        sections = {
            "broker": {"kind": "rabbitmq", "amqp_url": amqp_url},
            "store": {"kind": "redis", "redis_url": redis_url},
        }
    settings = make_settings(
        job,
        job={"rounds": 1},
        rounds={"deadline_s": DEADLINE_S, "quorum": 0.5},
        **sections,
    )
    embedded = Embedded() if request.param == "memory" else None
    backends = Backends(settings.broker, settings.store, embedded)
    yield settings, backends
    if request.param != "memory":
        delete_all(backends, settings, list(SAMPLES))


def welcomes(fake: FakeClient) -> int:
    return sum(isinstance(m, Welcome) for m in list(fake.received))


@pytest.mark.parametrize(
    ("how", "session"),
    [
        ("left", "c-2"),  # SIGTERM: a Leave, then a new process joins
        ("left", ""),  # the same by a client that names no session: the coordinator mints one
        ("restarted", "c-2"),  # SIGKILL: no Leave, a new process joins before the old expires
    ],
)
def test_a_member_that_rejoins_as_a_new_process_is_not_waited_for(
    backends: tuple[Settings, Backends], how: str, session: str
) -> None:
    settings, handles = backends
    job = settings.job.name
    store = handles.open_store()
    control = handles.open_broker("test-control")
    try:
        ensure_initial_version(store, settings, build_strategy(settings.algorithm.name), LOG)
        declare_all(handles, settings, list(SAMPLES))
        fakes = {c: FakeClient(c, n, lambda r: 1.0) for c, n in SAMPLES.items()}
        assigned: list[WeightsAssignment] = []

        def killed_mid_round(fake: FakeClient, assignment: WeightsAssignment) -> list[bytes]:
            assigned.append(assignment)  # the old process dies with it, unanswered
            return []

        fakes["c"].script = killed_mid_round
        worker = FakeWorker(store.read_blob(job, 1, BlobRef(SERVER_PART)), lambda r: 5.0)

        def send(message: Message) -> None:
            control.publish(CONTROL_EXCHANGE, job, encode(message))

        def join(client: str, session: str) -> None:
            info = {"session": session} if session else {}
            send(Join(job, client, new_message_id(), 1, SAMPLES[client], 0, info))

        clock = ManualClock()
        sink = ListSink()
        aggregator = Aggregator(settings, handles, sink=sink, clock=clock, poll_s=0.02)
        coordinator_clock = ManualClock()
        coordinator = Coordinator(settings, handles, clock=coordinator_clock, poll_s=0.02)
        result: list[list[VersionRecord]] = []
        done = threading.Event()

        def aggregate(stop: threading.Event) -> None:
            result.append(aggregator.run(stop))
            done.set()

        peers: list[Callable[[threading.Event], object]]
        peers = [client_loop(handles, job, f) for f in fakes.values()]
        peers += [worker_loop(handles, job, 1, worker), coordinator.run, aggregate]
        with running(peers):
            for client in SAMPLES:
                join(client, f"{client}-1")
            wait_until(lambda: bool(assigned) and fakes["a"].sent + fakes["b"].sent == 2, "a+b")
            before = client_members(store, job)["c"]
            if how == "left":
                send(Leave(job, "c", new_message_id(), 1, "stopped"))
            coordinator_clock.advance(REWELCOME_S)  # the coordinator's interval (welcomes.py)
            join("c", session)
            wait_until(lambda: welcomes(fakes["c"]) == 2, "c's second Welcome")
            after = client_members(store, job)["c"]
            clock.advance(2.0)  # one membership read later, far from the deadline
            finished = done.wait(WAIT_S)
            assert finished, "the round waited for the rejoined client's update"
    finally:
        control.close()
        store.close()

    assert after.session != before.session == "c-1"
    assert (after.partition, after.shard) == (before.partition, before.shard)
    assert [(r.round, r.participants) for r in result[0]] == [(1, 2)]
    assert sink.status == "finished"
    assert [a.round for a in assigned] == [0]
