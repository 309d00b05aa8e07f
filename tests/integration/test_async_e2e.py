"""Async mode end to end: every role its own OS process over real RabbitMQ and Redis.

A coordinator, an aggregator in async mode (K = 2), two workers (sharded SFL, S = 2: the
replicas train continuously and are folded and rebased through Redis) and clients that come
and go while versions are published:

- three clients from the start; a fourth starts once version 3 is out and takes part;
- one client is stopped with SIGTERM (it sends its Leave) and another SIGKILLed (its
  membership expires) while the job runs; neither appears in a version published after its
  last update could have arrived;
- the job publishes every version, learns, and its report carries the staleness histogram.
"""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from broker.store import WeightStore
from services.common.backends import Backends
from services.common.membership import member_id
from services.config.loading import load_settings
from services.config.root import Settings
from services.runtime.processes import ChildSpec, child_env, clear_job
from tests.integration.test_service_e2e import Roles, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.rabbitmq, pytest.mark.redis]

VERSIONS = 30
CLIENTS = 4
SHARDS = 2
LATE = "client-3"
LEAVER = "client-0"  # SIGTERM: a Leave
VICTIM = "client-1"  # SIGKILL: expiry

CONFIG = """
[broker]
kind = "rabbitmq"
amqp_url = "{amqp_url}"

[store]
kind = "redis"
redis_url = "{redis_url}"
keep_versions = 30

[job]
name = "set-by-env"
rounds = {versions}
seed = 2

[model]
name = "cnn5"
cut = "block1"

[data]
dataset = "fashion_mnist_sample"
eval_samples = 500

[algorithm]
name = "sfl"
shards = {shards}
batch_size = 32
lr = 0.05
momentum = 0.9
max_steps_per_round = 8

[clients]
count = {clients}
heartbeat_s = 1
heartbeat_ttl_s = 6

[rounds]
mode = "async"

[asynchronous]
buffer_size = 2
max_staleness = 6
worker_max_staleness = 6

[workers]
count = 2
checkpoint_every_steps = 8

[report]
plots = true
"""


@pytest.fixture
def setup(
    tmp_path: Path, amqp_url: str, redis_url: str, job: str
) -> Iterator[tuple[Path, Settings, dict[str, str]]]:
    path = tmp_path / "async.toml"
    path.write_text(
        CONFIG.format(
            amqp_url=amqp_url,
            redis_url=redis_url,
            versions=VERSIONS,
            shards=SHARDS,
            clients=CLIENTS,
        )
    )
    base = {k: v for k, v in os.environ.items() if not k.startswith("SPLITMQ_")}
    base["SPLITMQ_JOB__NAME"] = job
    base["OMP_NUM_THREADS"] = "1"
    base["MKL_NUM_THREADS"] = "1"
    env = child_env(base, workers=2, clients=CLIENTS)
    settings = load_settings(path, env)
    assert settings.asynchronous_mode and settings.shards == SHARDS
    yield path, settings, env
    clear_job(settings, [f"client-{i}" for i in range(CLIENTS)])


def participants(store: WeightStore, job: str) -> dict[int, list[str]]:
    out: dict[int, list[str]] = {}
    for v in store.versions(job):
        if v > 1:
            out[v] = store.manifest(job, v).meta.get("participants", "").split(",")
    return out


@pytest.mark.timeout(420)
def test_async_service_with_clients_joining_and_leaving(
    setup: tuple[Path, Settings, dict[str, str]], tmp_path: Path, job: str
) -> None:
    config, settings, env = setup
    runs, logs = tmp_path / "runs", tmp_path / "logs"
    logs.mkdir()
    roles = Roles(config, env, logs)
    store = Backends(settings.broker, settings.store).open_store()
    gone: dict[str, int] = {}  # client -> the version current when it was stopped
    dead: frozenset[str] = frozenset()

    def version() -> int:
        return store.current_version(job)

    def client(name: str) -> None:
        index = name.rsplit("-", 1)[1]
        roles.start(ChildSpec(name, "client", ("--id", name, "--partition", index)))

    try:
        roles.start(ChildSpec("aggregator", "aggregator", ("--report-dir", str(runs))))
        roles.start(ChildSpec("coordinator", "coordinator"))
        for i in range(2):
            roles.start(ChildSpec(f"worker-{i}", "worker", ("--id", f"worker-{i}")))
        wait_for(lambda: version() >= 1 or None, 120, "version 1", roles)
        for i in range(CLIENTS - 1):
            client(f"client-{i}")
        wait_for(lambda: version() >= 3 or None, 180, "version 3", roles, poll_s=0.02)
        # Starting a client costs seconds of CPU, more than a dozen versions take: hold the
        # aggregator (SIGSTOP) until the late client is a member, so it joins a running job.
        aggregator = roles.started["aggregator"]
        aggregator.process.send_signal(signal.SIGSTOP)
        try:
            joined_at = version()
            client(LATE)
            wait_for(
                lambda: member_id(LATE) in store.live_members(job) or None,
                180,
                f"{LATE} to join",
                roles,
            )
        finally:
            aggregator.process.send_signal(signal.SIGCONT)
        wait_for(
            lambda: any(LATE in who for who in participants(store, job).values()) or None,
            180,
            f"{LATE} to take part",
            roles,
        )
        # Both leavers have taken part by now (K = 2 of three, then four, clients).
        roles.started[LEAVER].process.send_signal(signal.SIGTERM)
        gone[LEAVER] = version()
        roles.started[VICTIM].process.send_signal(signal.SIGKILL)
        gone[VICTIM] = version()
        dead = frozenset({VICTIM, LEAVER})
        assert roles.started[LEAVER].process.wait(60) == 0
        wait_for(
            lambda: member_id(LEAVER) not in store.live_members(job) or None,
            30,
            f"{LEAVER} to leave",
            roles,
            exempt=dead,
        )
        wait_for(
            lambda: aggregator.process.poll() is not None or None,
            300,
            "the aggregator to publish every version",
            roles,
            exempt=dead | {"aggregator", "client-2", LATE},
            poll_s=0.2,
        )
        assert aggregator.process.returncode == 0, aggregator.output()[-4000:]
        for name in ("client-2", LATE):
            assert roles.started[name].process.wait(60) == 0, roles.started[name].output()[-3000:]
        for name in ("coordinator", "worker-0", "worker-1"):
            roles.started[name].process.send_signal(signal.SIGTERM)
        for name in ("coordinator", "worker-0", "worker-1"):
            assert roles.started[name].process.wait(30) == 0, roles.tails()
        for name, role in roles.started.items():
            assert "Traceback" not in role.output(), f"{name} crashed:\n{role.output()[-4000:]}"
        members = participants(store, job)
    finally:
        roles.kill_all()
        store.close()

    assert sorted(members) == list(range(2, VERSIONS + 2))
    assert all(len(who) == 2 for who in members.values()), members
    # The late client: only in versions published after it started, and in some.
    late = [v for v, who in members.items() if LATE in who]
    assert late and min(late) > joined_at, members
    # The leavers: an update in flight when stopped may still land in the next two versions
    # (it was sent before the stop; K = 2), none after.
    for name, at in gone.items():
        assert at + 2 < VERSIONS, f"{name} left too late to tell"
        assert all(name not in members[v] for v in members if v > at + 2), (name, at, members)

    (run_dir,) = runs.iterdir()
    doc = json.loads((run_dir / "metrics.json").read_text())
    assert doc["run"]["status"] == "finished"
    records = doc["records"]
    # Shown with `pytest -s`: what each version got.
    print(f"\nasync e2e: {LATE} started at version {joined_at}, leavers stopped at {gone}")
    for r in records:
        extra = r["extra"]
        print(
            f"  v{r['version']}: accuracy {r['global_accuracy']:.3f}, "
            f"participants {members[r['version']]}, staleness mean "
            f"{extra['staleness_mean']:.2f}, replicas {extra['replicas']:.0f}"
        )
    assert [r["version"] for r in records] == list(range(2, VERSIONS + 2))
    assert records[-1]["global_accuracy"] > 0.5, [r["global_accuracy"] for r in records]
    histogram = [
        (key, value)
        for r in records
        for key, value in r["extra"].items()
        if key.startswith("staleness.")
    ]
    assert sum(v for _, v in histogram) == 2 * VERSIONS
    assert (run_dir / "staleness.png").stat().st_size > 0
    # The server side was folded from both shards' replicas along the way.
    assert any(r["extra"].get("replicas", 0) == SHARDS for r in records), records
