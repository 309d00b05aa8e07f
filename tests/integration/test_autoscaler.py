"""The autoscaler with its local-process backend, on real RabbitMQ and Redis (issue 6).

Aggregator, coordinator and six clients run as threads of this process; the workers are real
`splitmq worker` processes that the autoscaler starts and stops. The job has S = 3 shards and
the autoscaler may run 1 to 3 workers. The burst of clients must drive the pool to 3 workers,
each holding a shard; once the clients are gone the pool must come back to 1, each surplus
worker stopping gracefully (SIGTERM, exit code 0, shards handed over), and every batch the
clients sent must be applied exactly once (the shard checkpoints' `applied` counts are the
exactly-once record; design §7).

Timings are short on purpose (cool-down 2 s, idle for 5 s before scaling down, leases of 5 s).
"""

from __future__ import annotations

import functools
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
from click.testing import CliRunner

from broker.topology import dead_queue_name
from services.autoscaler.controller import Autoscaler
from services.autoscaler.local import LocalProcessPool
from services.cli.main import cli
from services.client.data import JobData
from services.client.stats import ClientStats
from services.common.backends import Backends
from services.config.loading import load_settings
from services.config.root import Settings
from services.data.loaders import load_dataset
from services.report.records import ListSink
from services.runtime.processes import clear_job
from services.runtime.roles import build_aggregator, build_client, build_coordinator
from tests.contract.test_store_contract import lease_owner
from tests.unit.test_worker_support import one_torch_thread

__all__ = ["one_torch_thread"]

pytestmark = [pytest.mark.slow, pytest.mark.rabbitmq, pytest.mark.redis]

CLIENTS = 6
SHARDS = 3
T = TypeVar("T")

CONFIG = """
[broker]
kind = "rabbitmq"
amqp_url = "{amqp_url}"

[store]
kind = "redis"
redis_url = "{redis_url}"

[job]
name = "set-by-env"
# More than the test lets happen: it stops the clients itself once the pool is at its maximum.
rounds = 50
seed = 3

[model]
name = "cnn5"
cut = "block1"

[data]
eval_samples = 200

[algorithm]
name = "sfl"
shards = {shards}
batch_size = 32
lr = 0.05
momentum = 0.9

[clients]
count = {clients}
min_to_start = {clients}
heartbeat_s = 1
heartbeat_ttl_s = 30

[rounds]
deadline_s = 60

[workers]
lease_ttl_s = 5
checkpoint_every_steps = 5
checkpoint_every_s = 1

[autoscaler]
min_workers = 1
max_workers = 3
target_depth_per_worker = 8
scale_up_busy = 0.5
scale_down_busy = 0.15
cooldown_s = 2
scale_down_after_s = 5
poll_s = 0.5
stop_timeout_s = 60

[report]
plots = false
"""


@pytest.fixture
def setup(
    tmp_path: Path, amqp_url: str, redis_url: str, job: str
) -> Iterator[tuple[Path, Settings, dict[str, str]]]:
    path = tmp_path / "autoscale.toml"
    path.write_text(
        CONFIG.format(amqp_url=amqp_url, redis_url=redis_url, shards=SHARDS, clients=CLIENTS)
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPLITMQ_")}
    env["SPLITMQ_JOB__NAME"] = job
    # Several processes on a small machine: one torch thread each.
    env["OMP_NUM_THREADS"] = "1"
    env["MKL_NUM_THREADS"] = "1"
    settings = load_settings(path, env)
    assert settings.shards == SHARDS
    yield path, settings, env
    clear_job(settings, [f"c{i}" for i in range(CLIENTS)])


class Threads:
    """Roles as threads of the test; the first failure is kept for the assertion messages."""

    def __init__(self) -> None:
        self.threads: dict[str, threading.Thread] = {}
        self.results: dict[str, Any] = {}
        self.errors: dict[str, BaseException] = {}

    def start(self, name: str, target: Callable[[], Any]) -> None:
        def main() -> None:
            try:
                self.results[name] = target()
            except BaseException as exc:
                self.errors[name] = exc

        thread = threading.Thread(target=main, name=name, daemon=True)
        self.threads[name] = thread
        thread.start()

    def join(self, names: list[str], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        for name in names:
            self.threads[name].join(max(0.1, deadline - time.monotonic()))
            assert not self.threads[name].is_alive(), f"{name} did not stop"


def wait_until(
    probe: Callable[[], T | None], timeout_s: float, what: str, context: Callable[[], str]
) -> T:
    deadline = time.monotonic() + timeout_s
    while True:
        value = probe()
        if value is not None and value is not False:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout_s:.0f} s waiting for {what}\n{context()}")
        time.sleep(0.1)


def check(config: Path, env: dict[str, str], *args: str) -> tuple[int, str]:
    clean: dict[str, str | None] = {k: None for k in os.environ if k.startswith("SPLITMQ_")}
    result = CliRunner().invoke(
        cli, ["--config", str(config), "check", *args], env={**clean, **env}
    )
    return result.exit_code, result.output.strip()


@pytest.mark.timeout(300)
def test_a_burst_scales_workers_to_the_max_and_idleness_back_to_the_min(
    setup: tuple[Path, Settings, dict[str, str]], tmp_path: Path, job: str
) -> None:
    config, settings, env = setup
    backends = Backends(settings.broker, settings.store)
    store = backends.open_store()
    logs = tmp_path / "workers"
    pool = LocalProcessPool(config, env, prefix="auto", log_dir=logs, stop_timeout_s=60)
    autoscaler = Autoscaler(settings, backends, pool)
    roles = Threads()
    stop_services, stop_clients, stop_autoscaler = (threading.Event() for _ in range(3))
    t0 = time.monotonic()
    timings: dict[str, float] = {}

    def mark(what: str) -> None:
        timings[what] = round(time.monotonic() - t0, 1)

    def context() -> str:
        tails = "\n".join(
            f"--- {p.name}\n{p.read_text(errors='replace')[-1500:]}"
            for p in sorted(logs.glob("*.log"))
        )
        events = "\n".join(map(str, autoscaler.events))
        return f"timings {timings}\nerrors {roles.errors}\nevents:\n{events}\n{tails}"

    def owners() -> list[str | None]:
        return [lease_owner(store, job, f"shard:{s}") for s in range(SHARDS)]

    try:
        sink = ListSink()
        aggregator = build_aggregator(settings, backends, sink=sink)
        roles.start("aggregator", lambda: aggregator.run(stop_services))
        roles.start("coordinator", lambda: build_coordinator(settings, backends).run(stop_services))
        roles.start("autoscaler", lambda: autoscaler.run(stop_autoscaler))
        data = JobData(settings, load_dataset(settings.data.dataset))
        for i in range(CLIENTS):
            client = build_client(settings, backends, client_id=f"c{i}", partition=i, dataset=data)
            roles.start(f"c{i}", functools.partial(client.run, stop_clients))
        # The clients come while the first worker (the minimum) is still starting; then the
        # burst: three workers, each with a shard of its own (S = 3).
        wait_until(
            lambda: autoscaler.running == 3 and len(set(owners()) - {None}) == SHARDS,
            120,
            "three workers holding one shard each",
            context,
        )
        mark("three workers busy")
        assert not roles.errors, roles.errors
        names = sorted({e.worker for e in autoscaler.events if e.action == "start"})
        code, out = check(config, env, "worker", "--id", names[-1])
        assert code == 0 and out.startswith(f"healthy: worker {names[-1]} alive"), out

        # Idle: the clients are gone, and so are the workers beyond the minimum.
        stop_clients.set()
        clients = [f"c{i}" for i in range(CLIENTS)]
        roles.join(clients, 60)
        mark("clients stopped")
        wait_until(
            lambda: (
                autoscaler.running == 1
                and sum(e.action == "exited" for e in autoscaler.events) == 2
            ),
            90,
            "the pool back at one worker",
            context,
        )
        mark("one worker again")
        stats: list[ClientStats] = [roles.results[c] for c in clients]
        sent = sum(s.batches_sent for s in stats)

        def applied() -> int | None:
            checkpoints = [store.load_checkpoint(job, s) for s in range(SHARDS)]
            total = sum(c.applied for c in checkpoints if c is not None)
            return total if total >= sent else None

        total = wait_until(applied, 30, f"all {sent} batches in the checkpoints", context)
        mark("all batches checkpointed")
        gone = next(e.worker for e in autoscaler.events if e.action == "exited")
        code, out = check(config, env, "worker", "--id", gone)
        assert code == 1 and out.startswith(f"unhealthy: no live worker named {gone}"), out
    finally:
        stop_clients.set()
        stop_autoscaler.set()
        stop_services.set()
        for thread in roles.threads.values():
            thread.join(60)
        dead = backends.open_broker(f"{job}-check")
        try:
            dead_letters = dead.queue_depth(dead_queue_name(job))
        finally:
            dead.close()
        store.close()
    print(f"\nautoscaler timings (s): {timings}")
    for event in autoscaler.events:
        print(f"  {event.at - t0:6.1f} s {event.action:<7} {event.worker} -> {event.running}")

    assert not roles.errors, roles.errors
    # Up to the maximum under the burst, one at a time, and back to the minimum when idle.
    starts = [e for e in autoscaler.events if e.action == "start"]
    stops = [e for e in autoscaler.events if e.action == "stop"]
    assert [e.running for e in starts] == [1, 2, 3]
    assert starts[0].reason == "below the minimum of 1"
    assert [e.running for e in stops] == [2, 1]
    assert all("busy" in e.reason or "ready" in e.reason for e in starts[1:])
    assert all(e.reason.startswith("idle for") for e in stops)
    # Scaled-down workers and, at the end, the last one all stopped by SIGTERM, cleanly.
    exits = {e.worker: e.reason for e in autoscaler.events if e.action == "exited"}
    assert exits == {e.worker: "exit code 0" for e in starts}
    for log in sorted(logs.glob("*.log")):
        text = log.read_text(errors="replace")
        assert "Traceback" not in text, f"{log.name}:\n{text[-3000:]}"
        assert "shards_lost=0" in text, f"{log.name} lost a lease:\n{text[-3000:]}"
    for event in stops:
        assert "handed over" in (logs / f"{event.worker}.log").read_text()
    # No batch lost, none applied twice: what the clients sent is what the shards applied.
    assert sent > 0 and total == sent
    assert dead_letters == 0
    assert sink.records, "no version was published during the burst"
