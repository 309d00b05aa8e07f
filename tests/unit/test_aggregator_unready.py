"""Members without training samples are not counted as ready for a round (in-memory hub).

A client started without a partition first joins with 0 samples and joins again with its
count once the Welcome told it its partition; a client whose partition is empty stays at 0.
A round that counted either would name it in its RoundStart with 0 samples, which the worker
dead-letters as `bad_cohort` (compose/smoke.sh saw one in round 0 of every run).
"""

from __future__ import annotations

import logging

import pytest

from broker.messages import RoundStart
from broker.topology import dead_queue_name
from broker.transport import REASON_HEADER, Delivery
from services.aggregator.aggregator import Aggregator
from services.common.checks.addressing import SameJob, SameShard
from services.report.records import ListSink
from tests.unit.test_aggregator import SAMPLES, Job, client_value, wait_until
from tests.unit.test_aggregator_peers import FakeClient, add_member, make_settings
from workers.shard_checks import parse_cohort

UNREADY = "has no training samples"


def worker_refusals(job: str, starts: list[RoundStart]) -> list[tuple[str, str]]:
    """What a real worker would have dead-lettered of these RoundStarts (its own check)."""
    problems = []
    for start in starts:
        delivery = Delivery(body=b"", queue="q", routing_key="q", tag=1)
        problem = (
            SameJob(job)(delivery, start)
            or SameShard(start.shard)(delivery, start)
            or parse_cohort(start)[1]
        )
        if problem is not None:
            problems.append((problem.code, problem.detail))
    return problems


def dead_letters(j: Job) -> list[str]:
    broker = j.backends.open_broker("dead")
    try:
        broker.subscribe(dead_queue_name(j.name), prefetch=10)
        reasons = []
        while (delivery := broker.get(0.2)) is not None:
            reasons.append(str(delivery.headers[REASON_HEADER]))
            broker.ack(delivery)
        return reasons
    finally:
        broker.close()


def unready_logs(caplog: pytest.LogCaptureFixture, client: str) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if UNREADY in r.getMessage() and f"client {client} " in r.getMessage()
    ]


def test_a_client_with_an_empty_partition_is_left_out_and_the_rounds_go_on(
    job: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="splitmq.aggregator")
    j = Job(make_settings(job, clients={"count": 4, "min_to_start": 3}), "abcd", members="abc")
    add_member(j.store, job, "d", samples=0, partition=3)
    j.clients["d"] = FakeClient("d", 0, client_value(3))  # it would report 0 samples too

    records = j.run(Aggregator(j.settings, j.backends, sink=ListSink()))

    assert [(r.round, r.participants) for r in records] == [(1, 3), (2, 3)]
    assert [set(s.participants) for s in j.worker.starts] == [set("abc")] * 2
    assert worker_refusals(job, j.worker.starts) == []
    assert dead_letters(j) == []
    # Never assigned a round; dismissed with the others when the job finished.
    assert [(a.round, a.participate) for a in j.clients["d"].assignments()] == [(2, False)]
    assert unready_logs(caplog, "d") == [
        f"job {job}: client d (partition 3) has no training samples (yet): it is left out of "
        "the cohorts until it reports some"
    ]


def test_a_client_joining_with_0_samples_counts_once_it_joins_again_with_its_count(
    job: str, caplog: pytest.LogCaptureFixture
) -> None:
    # compose's clients: all min_to_start members are there, but one has only sent its first
    # Join (no partition yet, 0 samples). Round 0 must wait for its second Join.
    caplog.set_level(logging.INFO, logger="splitmq.aggregator")
    j = Job(make_settings(job, clients={"count": 4, "min_to_start": 4}), "abcd", members="abc")
    add_member(j.store, job, "d", samples=0, partition=3)

    def second_join() -> None:
        wait_until(lambda: bool(unready_logs(caplog, "d")), "the aggregator to see d unready")
        assert j.worker.starts == [], "round 0 opened without d"
        add_member(j.store, job, "d", samples=SAMPLES["d"], partition=3)

    records = j.run(Aggregator(j.settings, j.backends, sink=ListSink()), during=second_join)

    assert [(r.round, r.participants) for r in records] == [(1, 4), (2, 4)]
    assert [dict(s.participants) for s in j.worker.starts] == [SAMPLES] * 2
    assert worker_refusals(job, j.worker.starts) == []
    assert dead_letters(j) == []
    assert len(unready_logs(caplog, "d")) == 1
