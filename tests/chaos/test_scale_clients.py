"""The CI variant of benchmarks/scale_clients.py: 200 live clients on one client host over the
real RabbitMQ and Redis, 10% per round, with churn from a generated availability trace, and one
standalone `splitmq client` process beside them in the same job; every client joins, the job
finishes, every batch a client sent is applied once and nothing is dead-lettered. The full
run (100 / 300 / 1,000 clients, SFL and FedAvg) is `python -m benchmarks.scale_clients`; its
results are in docs/benchmarks.md."""

from __future__ import annotations

import pytest

from benchmarks.scale_clients import ScaleConfig, run_point

pytestmark = [pytest.mark.rabbitmq, pytest.mark.redis, pytest.mark.slow]


@pytest.mark.timeout(300)
def test_two_hundred_clients_on_a_host_train_through_churn_and_lose_nothing(
    amqp_url: str, redis_url: str
) -> None:
    cfg = ScaleConfig(
        clients=200,
        algorithm="sfl",
        rounds=4,
        per_host=200,
        standalone=1,
        dataset="fashion_mnist_sample",
        amqp_url=amqp_url,
        redis_url=redis_url,
        timeout_s=240.0,
    )
    report = run_point(cfg)
    assert report.status == "finished", report
    assert report.hosts == 1 and report.joined == 200
    assert report.rounds == 4
    assert report.sessions > 200 and report.offline_events > 0  # clients left and came back
    assert report.sent == report.applied > 0
    assert report.lost == report.duplicates == report.dead_lettered == 0, report.dead_reasons
    assert report.clients_sent_ne_applied == 0
    # The standalone client was a member throughout (sampled into some rounds or not: the
    # cohorts depend on who is online) and was dismissed with the others at the job's end.
    assert report.standalone_finished == 1
    assert not report.problems, report.problems
