"""`splitmq check` on real RabbitMQ and Redis, healthy verdicts included, imports no torch.

The unit test (tests/unit/test_cli_imports.py) covers the failing paths without services;
here the checks reach the servers and read a live health key, the path a healthy container
takes every few seconds.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from broker.redis_store import RedisWeightStore
from services.common.health import health_member
from tests.unit.test_cli_imports import splitmq

pytestmark = [pytest.mark.rabbitmq, pytest.mark.redis]


@pytest.fixture
def config(tmp_path: Path, job: str, amqp_url: str, redis_url: str) -> Path:
    path = tmp_path / "job.toml"
    path.write_text(
        f'[job]\nname = "{job}"\n[broker]\nkind = "rabbitmq"\namqp_url = "{amqp_url}"\n'
        f'[store]\nkind = "redis"\nredis_url = "{redis_url}"\n'
    )
    return path


def test_healthy_checks_do_not_import_torch(config: Path, job: str, redis_url: str) -> None:
    store = RedisWeightStore(redis_url)
    try:
        # What a worker's HealthBeat writes (services.common.health).
        store.heartbeat(job, health_member("worker", "w1"), 30.0, {"host": "h", "pid": "7"})
        out, heavy = splitmq(["--config", str(config), "check", "worker", "--id", "w1"])
        assert out.startswith(f"healthy: worker w1 alive in job {job} (pid 7 on h"), out
        assert heavy == []
        for service in ("broker", "store"):
            out, heavy = splitmq(["--config", str(config), "check", service])
            assert out.startswith("healthy: "), out
            assert heavy == []
    finally:
        store.remove_member(job, health_member("worker", "w1"))
        store.close()
