"""Health keys (services/common/health.py) and `splitmq check` without real services."""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable, Mapping
from pathlib import Path

import pytest
from click.testing import CliRunner

from broker.errors import StoreUnavailableError
from broker.memory_store import InMemoryWeightStore
from broker.store import Member
from services.cli.main import cli
from services.common.health import HealthBeat, assess, health_member


def members(**hosts: str) -> dict[str, Member]:
    """health:worker:<instance> members on the given hosts, expiring at t=100."""
    return {
        health_member("worker", i): Member(health_member("worker", i), 100.0, {"host": h})
        for i, h in hosts.items()
    }


def test_a_live_key_from_this_host_is_healthy() -> None:
    live = {**members(a="h1", b="h2"), "worker:a": Member("worker:a", 200.0, {"host": "h1"})}
    verdict = assess(live, "worker", job="j", host="h2", now=90.0)
    assert verdict.ok
    assert verdict.reason == "worker b alive in job j (pid ? on h2, health key expires in 10 s)"


def test_no_key_from_this_host_is_unhealthy_and_says_where_others_are() -> None:
    verdict = assess(members(a="h1", b="h1"), "worker", job="j", host="h3")
    assert not verdict.ok
    assert verdict.reason == "no live worker on host h3 in job j (2 live elsewhere)"
    assert assess({}, "coordinator", job="j").reason == "no live coordinator anywhere in job j"


def test_an_instance_or_any_host_can_be_asked_for() -> None:
    live = members(a="h1", b="h2")
    assert assess(live, "worker", job="j", instance="a").ok
    assert not assess(live, "worker", job="j", instance="c").ok
    assert assess(live, "worker", job="j").ok
    assert not assess(live, "client", job="j").ok  # other roles' keys do not count


def poll(probe: Callable[[], bool], timeout_s: float = 5.0) -> bool:
    pause = threading.Event()
    for _ in range(int(timeout_s / 0.01)):
        if probe():
            return True
        pause.wait(0.01)
    return False


def test_a_beat_refreshes_its_key_while_running_and_removes_it_on_stop(job: str) -> None:
    store = InMemoryWeightStore()
    beat = HealthBeat(lambda: store, job, "client", "c7", refresh_s=0.02, ttl_s=0.2)
    with beat:
        key = health_member("client", "c7")
        assert poll(lambda: key in store.live_members(job))
        info = store.live_members(job)[key].info
        assert info["host"] == socket.gethostname() and int(info["pid"]) > 0
        threading.Event().wait(0.5)  # beyond the TTL: only refreshing keeps it alive
        assert key in store.live_members(job)
    assert key not in store.live_members(job)


class FlakyStore(InMemoryWeightStore):
    """Down until `up` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.up = threading.Event()
        self.failures = 0

    def heartbeat(
        self, job: str, member_id: str, ttl_s: float, info: Mapping[str, str] | None = None
    ) -> None:
        if not self.up.is_set():
            self.failures += 1
            raise StoreUnavailableError("redis unreachable")
        super().heartbeat(job, member_id, ttl_s, info)


def test_a_beat_outlives_a_store_outage_and_logs_it_once(
    job: str, caplog: pytest.LogCaptureFixture
) -> None:
    store = FlakyStore()
    with (
        caplog.at_level(logging.INFO, "splitmq.health"),
        HealthBeat(lambda: store, job, "worker", "w", refresh_s=0.01, ttl_s=1.0),
    ):
        assert poll(lambda: store.failures >= 5)
        store.up.set()
        assert poll(lambda: health_member("worker", "w") in store.live_members(job))
    messages = [r.getMessage() for r in caplog.records]
    assert sum("cannot refresh" in m for m in messages) == 1
    assert sum("refreshed again" in m for m in messages) == 1


def test_a_refresh_period_not_below_the_ttl_is_refused() -> None:
    with pytest.raises(ValueError, match="below the TTL"):
        HealthBeat(InMemoryWeightStore, "j", "worker", "w", refresh_s=5, ttl_s=5)


@pytest.fixture
def memory_config(tmp_path: Path) -> Path:
    path = tmp_path / "job.toml"
    path.write_text('[job]\nname = "clitest"\n')
    return path


def check(args: list[str]) -> tuple[int, str]:
    env: dict[str, str | None] = {"SPLITMQ_CONFIG": None, "SPLITMQ_BROKER": None}
    env |= {"SPLITMQ_STORE": None, "SPLITMQ_AMQP_URL": None, "SPLITMQ_REDIS_URL": None}
    result = CliRunner().invoke(cli, args, env=env, prog_name="splitmq")
    return result.exit_code, result.output


@pytest.mark.parametrize("role", ["coordinator", "aggregator", "worker", "autoscaler"])
def test_check_of_a_role_needs_a_shared_store(memory_config: Path, role: str) -> None:
    code, out = check(["--config", str(memory_config), "check", role])
    assert code == 1
    assert out.startswith(f"unhealthy: a {role} outside this process can only be seen")
    assert len(out.strip().splitlines()) == 1


def test_check_of_a_client_reads_its_health_file_not_the_store(memory_config: Path) -> None:
    # Clients hold no store credentials (design §3): no store is needed to check one.
    code, out = check(["--config", str(memory_config), "check", "client", "--id", "nobody-here"])
    assert (code, out.strip()) == (1, "unhealthy: no live client named nobody-here in job clitest")


@pytest.mark.parametrize("role", ["broker", "store"])
def test_check_of_an_in_memory_service_is_unhealthy(memory_config: Path, role: str) -> None:
    code, out = check(["--config", str(memory_config), "check", role])
    assert (code, out.strip()) == (
        1,
        f"unhealthy: {role}.kind is memory: it lives inside one process, none to check",
    )


def test_check_refuses_an_unknown_role(memory_config: Path) -> None:
    code, out = check(["--config", str(memory_config), "check", "dashboard"])
    assert code == 2 and "'dashboard' is not one of 'coordinator'" in out
