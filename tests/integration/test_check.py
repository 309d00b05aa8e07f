"""`splitmq check` against real RabbitMQ and Redis: probes, and a role's health key."""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner

from services.cli.main import cli
from services.common.backends import Backends
from services.common.health import HealthBeat
from services.config.loading import load_settings

pytestmark = [pytest.mark.rabbitmq, pytest.mark.redis]


@pytest.fixture
def config(tmp_path: Path, amqp_url: str, redis_url: str, job: str) -> Iterator[Path]:
    path = tmp_path / "job.toml"
    path.write_text(
        f'[broker]\nkind = "rabbitmq"\namqp_url = "{amqp_url}"\n'
        f'[store]\nkind = "redis"\nredis_url = "{redis_url}"\n'
        f'[job]\nname = "{job}"\n'
    )
    yield path
    settings = load_settings(path, {})
    store = Backends(settings.broker, settings.store).open_store()
    try:
        store.delete_job(job)
    finally:
        store.close()


def check(config: Path, *args: str) -> tuple[int, str]:
    clean: dict[str, str | None] = {k: None for k in os.environ if k.startswith("SPLITMQ_")}
    result = CliRunner().invoke(cli, ["--config", str(config), "check", *args], env=clean)
    return result.exit_code, result.output.strip()


def test_broker_and_store_probes_pass_on_live_services(config: Path) -> None:
    code, out = check(config, "broker")
    assert code == 0 and out.startswith("healthy: RabbitMQ "), out
    assert "declare ok, publish ok" in out
    code, out = check(config, "store")
    assert code == 0 and out.startswith("healthy: Redis "), out
    assert "write ok, read ok" in out


def test_probes_fail_with_a_reason_when_nothing_answers(tmp_path: Path) -> None:
    path = tmp_path / "nowhere.toml"
    path.write_text(
        '[broker]\nkind = "rabbitmq"\namqp_url = "amqp://guest:guest@127.0.0.1:1/%2F"\n'
        '[store]\nkind = "redis"\nredis_url = "redis://127.0.0.1:1/0"\n'
    )
    code, out = check(path, "store")
    assert code == 1 and out.startswith("unhealthy: cannot use Redis at redis://127.0.0.1:1/0")
    code, out = check(path, "worker")
    assert code == 1 and out.startswith("unhealthy: store unreachable, cannot see the worker")


def test_a_role_is_healthy_while_its_key_is_refreshed_from_this_host(
    config: Path, job: str
) -> None:
    settings = load_settings(config, {})
    backends = Backends(settings.broker, settings.store)
    code, out = check(config, "coordinator")
    assert (
        code == 1
        and out == f"unhealthy: no live coordinator on host {socket.gethostname()} in job {job}"
    )
    with HealthBeat(backends.open_store, job, "coordinator", "coord-1", refresh_s=0.2, ttl_s=2):
        deadline = time.monotonic() + 10
        while (result := check(config, "coordinator"))[0] != 0:
            assert time.monotonic() < deadline, result
            time.sleep(0.1)
        code, out = result
        assert out.startswith(f"healthy: coordinator coord-1 alive in job {job} (pid {os.getpid()}")
        assert check(config, "coordinator", "--id", "coord-2")[0] == 1
        assert check(config, "aggregator", "--anywhere")[0] == 1
    # Stopping removes the key at once (no waiting for the TTL).
    code, out = check(config, "coordinator")
    assert code == 1, out
