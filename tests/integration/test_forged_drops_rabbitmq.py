"""Junk in a member's name must not cost that member its round (issue 33, point 3).

Over a real RabbitMQ and Redis, in the open mode: just before client b's real update of round
2, a flood of well-formed RoundDropped notices claiming b (version 999, of a closed round), and
a few late-looking WeightsUpdates claiming a (version 999, the right tensors), are queued on
`<job>.updates`. Before, the inbox charged the claimed member's budget before judging, so b's
real update was dead-lettered `over_budget` and round 2 closed without it; and the gates acked
the "late" ones without looking at their version (answering a with `round_closed` errors for
updates it never sent). Now what the round accepts is never refused for a budget, and a late
message must name its round's version: all the junk is dead-lettered with a reason.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator

import pytest

from broker.codec import encode
from broker.messages import ABORTED, RoundDropped, WeightsAssignment, new_message_id
from broker.store import SERVER_PART, BlobRef
from broker.topology import dead_queue_name
from services.aggregator.aggregator import Aggregator, ensure_initial_version
from services.aggregator.budget import BURST
from services.algorithms.registry import build_strategy
from services.common.backends import Backends
from services.config.root import Settings
from services.report.records import ListSink
from tests.integration.test_flood_rabbitmq import take_reasons
from tests.unit.test_aggregator_peers import (
    WAIT_S,
    FakeClient,
    FakeWorker,
    ManualClock,
    add_member,
    client_loop,
    declare_all,
    delete_all,
    make_settings,
    running,
    worker_loop,
)

pytestmark = [pytest.mark.rabbitmq, pytest.mark.redis, pytest.mark.slow]

LOG = logging.getLogger("test.forged_drops")
SAMPLES = {"a": 10, "b": 30}
DROPS = 6 * BURST  # forged RoundDropped claiming b: several budgets' worth
UPDATES = 8  # forged late WeightsUpdates claiming a
FORGED_VERSION = 999


@pytest.fixture
def settings(job: str, amqp_url: str, redis_url: str) -> Iterator[Settings]:
    settings = make_settings(
        job,
        job={"rounds": 2},
        broker={"kind": "rabbitmq", "amqp_url": amqp_url},
        store={"kind": "redis", "redis_url": redis_url},
        clients={"count": 2, "min_to_start": 2},
        # quorum 1: a round without b's update waits out twice the deadline, then closes alone.
        rounds={"deadline_s": 5.0, "quorum": 1.0},
    )
    yield settings
    delete_all(Backends(settings.broker, settings.store), settings, list(SAMPLES))


def test_forged_drops_and_late_junk_in_a_members_name_cost_it_nothing(
    settings: Settings,
) -> None:
    job = settings.job.name
    backends = Backends(settings.broker, settings.store)
    store = backends.open_store()
    try:
        ensure_initial_version(store, settings, build_strategy("sfl_v2"), LOG)
        for i, (client, samples) in enumerate(SAMPLES.items()):
            add_member(store, job, client, samples=samples, partition=i)
        declare_all(backends, settings, list(SAMPLES))
        fakes = {c: FakeClient(c, n, lambda r: 1.0) for c, n in SAMPLES.items()}

        def flood_then_update(fake: FakeClient, assignment: WeightsAssignment) -> list[bytes]:
            real = [encode(fake.update(assignment))]
            if assignment.round == 0:
                return real
            drops = [
                encode(RoundDropped(job, "b", new_message_id(), FORGED_VERSION, 0, ABORTED))
                for _ in range(DROPS)
            ]
            late = fakes["a"].update(assignment)
            updates = [
                encode(
                    type(late)(
                        job, "a", new_message_id(), FORGED_VERSION, 0, 10, late.client_weights, {}
                    )
                )
                for _ in range(UPDATES)
            ]
            return [*drops, *updates, *real]

        fakes["b"].script = flood_then_update
        worker = FakeWorker(store.read_blob(job, 1, BlobRef(SERVER_PART)), lambda r: -1.0)
        sink = ListSink()
        # The budgets' clock held still: a drained budget stays drained, however slow the host.
        aggregator = Aggregator(settings, backends, sink=sink, pace=ManualClock(), poll_s=0.05)
        done = threading.Event()

        def aggregate(stop: threading.Event) -> None:
            aggregator.run(stop)
            done.set()

        peers = [client_loop(backends, job, f) for f in fakes.values()]
        peers.append(worker_loop(backends, job, 1, worker))
        with running([*peers, aggregate]):
            assert done.wait(WAIT_S), f"the job did not finish: {len(sink.records)} rounds"

        assert sink.status == "finished"
        # b's real update was taken in round 2, whatever was sent in its name before it.
        assert [(r.round, r.participants) for r in sink.records] == [(1, 2), (2, 2)]
        # No junk was acked as late, nor answered to the member it claimed.
        assert aggregator.inbox_stats.late == 0
        assert fakes["a"].errors() == []
        forged = DROPS + UPDATES
        broker = backends.open_broker("test-count")
        try:
            deadline = time.monotonic() + 10.0
            while broker.queue_depth(dead_queue_name(job)) < forged:
                assert time.monotonic() < deadline, broker.queue_depth(dead_queue_name(job))
                time.sleep(0.05)
            reasons = take_reasons(broker, dead_queue_name(job), forged)
        finally:
            broker.close()
        assert None not in reasons
        assert any(f"based on version {FORGED_VERSION}" in r for r in reasons if r), reasons[:3]
        assert all(
            f"based on version {FORGED_VERSION}" in r or r.startswith("over_budget: sender 'b'")
            for r in reasons
            if r
        ), sorted(set(reasons), key=str)[:5]
    finally:
        store.close()
