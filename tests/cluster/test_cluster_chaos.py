"""Cluster chaos, CI-sized (issue 12 item 5): a sharded SFL job over the local cluster (three
RabbitMQ nodes with quorum queues, Redis with Sentinel) while the RabbitMQ node leading a
shard queue is SIGKILLed, a worker is SIGKILLed during that failover, and later the Redis
primary is SIGKILLed and Sentinel promotes the replica. Every batch sent must be applied
exactly once and nothing dead-lettered.

The full run, with an undisturbed run of the same seed beside it, is
`python -m benchmarks.cluster_chaos`; its results are in docs/reliability.md.
"""

from __future__ import annotations

import pytest

from benchmarks.cluster import LocalCluster
from benchmarks.cluster_chaos import ChaosPlan, chaos_table, ensure_whole, run_chaos
from benchmarks.soak import SoakConfig

pytestmark = [pytest.mark.cluster, pytest.mark.slow]


@pytest.mark.timeout(420)
def test_node_kills_lose_nothing_and_the_job_finishes(cluster: LocalCluster) -> None:
    ensure_whole(cluster)
    cfg = SoakConfig(
        workers=3,
        clients=8,
        shards=3,
        rounds=3,
        steps=8,
        seed=5,
        timeout_s=360.0,
        amqp_urls=tuple(cluster.amqp_urls),
        redis_url=cluster.redis_url,
        sentinels=tuple(cluster.sentinels),
        min_replicas=1,
    )
    report = run_chaos(cluster, cfg, ChaosPlan(node_down_s=3.0))
    print(chaos_table(report))
    ensure_whole(cluster)  # later tests find the cluster whole

    soak = report.soak
    events = {e.name: e for e in report.events}
    assert sorted(events) == [
        "RabbitMQ leader SIGKILL",
        "RabbitMQ node back",
        "Redis primary SIGKILL",
        "worker SIGKILL",
    ]
    # Each kill came mid-training (the tap saw batches after it) and the cluster recovered.
    last = max(t for t in report.arrivals)
    for name in ("RabbitMQ leader SIGKILL", "worker SIGKILL", "Redis primary SIGKILL"):
        assert events[name].at_s < last, name
    assert events["RabbitMQ leader SIGKILL"].recovered_s is not None
    assert events["Redis primary SIGKILL"].recovered_s is not None
    assert soak.problems == []
    assert soak.status == "finished" and soak.versions == cfg.rounds
    assert soak.worker_kills == 1 and soak.workers_started == 1
    # Exactly once: per shard and client, the checkpoint's audit equals what was sent there.
    assert soak.sent > 0
    assert soak.lost == 0 and soak.duplicates == 0 and soak.checksum_mismatches == 0
    assert soak.dead_lettered == 0 and soak.applied == soak.sent
    assert soak.left_in_queues == 0
    assert soak.final_accuracy is not None and soak.final_accuracy > 0.4  # chance: 0.1
    assert report.ok
