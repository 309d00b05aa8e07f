"""A CI-sized soak run: sharded SFL as separate processes over the real RabbitMQ and Redis,
one worker SIGKILLed mid-training and one client leaving (SIGTERM) and rejoining; every batch
sent must be applied exactly once.

The full run (>= 20 clients, a worker killed every ~20 s, 30% churn, a broker restart) is
`python -m benchmarks.soak`; its results are in docs/reliability.md. No broker restart here:
other tests share the broker.
"""

from __future__ import annotations

import pytest

from benchmarks.soak import SoakConfig, run_once, table

pytestmark = [pytest.mark.rabbitmq, pytest.mark.redis, pytest.mark.slow]


@pytest.mark.timeout(300)
def test_soak_with_a_worker_killed_and_a_client_rejoining_loses_nothing(
    amqp_url: str, redis_url: str
) -> None:
    cfg = SoakConfig(
        workers=3,
        clients=8,
        shards=3,
        # Long enough that the leaving client is back before the end on a quiet machine too
        # (4 rounds of 15 steps finished in 29 s there, before its rejoin).
        rounds=6,
        steps=20,
        seed=3,
        kill_every_s=6.0,
        max_kills=1,
        churn=1 / 8,
        sigkill_share=0.0,
        leave_window_s=(3.0, 6.0),
        rejoin_after_s=6.0,
        timeout_s=240.0,
        amqp_url=amqp_url,
        redis_url=redis_url,
    )
    report = run_once(cfg)
    print(table(report, None))

    assert report.status == "finished" and report.versions == cfg.rounds
    assert report.worker_kills == 1 and report.workers_started == 1
    assert report.client_leaves_sigterm == 1 and report.client_rejoins == 1
    assert report.sent > 0 and report.sent >= report.sent_by_clients
    # Exactly once: per shard and client, the checkpoint's audit equals what was sent there.
    assert report.lost == 0 and report.duplicates == 0 and report.checksum_mismatches == 0
    assert report.applied == report.sent - report.dead_lettered_batches
    assert report.problems == []
    assert report.left_in_queues == 0
    assert report.final_accuracy is not None and report.final_accuracy > 0.4  # chance: 0.1
