"""`curl` every metrics endpoint of a `splitmq up` run over real RabbitMQ and Redis: the
coordinator (which also serves the dashboard), the aggregator and each worker, while the job
trains; then `splitmq dashboard` after it, on a queue nobody consumes any more.

The same `up` run is the test that `up` runs a job across processes (its output, its run
directory): one job of seven processes serves both, rather than starting a second one."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from broker.errors import UnroutableError
from broker.topology import (
    CONTROL_EXCHANGE,
    SMASHED_EXCHANGE,
    shard_routing_key,
    updates_routing_key,
)
from broker.transport import Broker
from services.common.backends import Backends
from services.config.loading import load_settings
from services.config.root import Settings
from services.config.runtime import usable_cores
from services.runtime.processes import clear_job
from tests.integration.scrape import Samples, missing, scrape, state, total, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.rabbitmq, pytest.mark.redis]

CONFIG = """
[broker]
kind = "rabbitmq"
amqp_url = "{amqp_url}"

[store]
kind = "redis"
redis_url = "{redis_url}"

[job]
name = "set-by-env"
rounds = 3

[data]
eval_samples = 300

[algorithm]
name = "sfl"
shards = 2
batch_size = 32
lr = 0.05
momentum = 0.9
max_steps_per_round = 8

[clients]
count = 3
min_to_start = 3
heartbeat_ttl_s = 60

[workers]
count = 2

[metrics]
port = 0
probe_s = 0.5
"""

ENDPOINT = re.compile(r"^(\S+)\s+\| metrics: (http://\S+)/metrics$")
ROLES = ("aggregator", "coordinator", "worker-0", "worker-1")


@pytest.fixture
def config(tmp_path: Path, amqp_url: str, redis_url: str, job: str) -> Iterator[Path]:
    path = tmp_path / "service.toml"
    path.write_text(CONFIG.format(amqp_url=amqp_url, redis_url=redis_url))
    yield path
    clear_job(load_settings(path, {"SPLITMQ_JOB__NAME": job}), [f"client-{i}" for i in range(3)])


def child_env(job: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPLITMQ_")}
    env["SPLITMQ_JOB__NAME"] = job
    return env


class Output:
    """A child's output lines, read on a thread, with the endpoints it printed."""

    def __init__(self, process: subprocess.Popen[str]) -> None:
        self.lines: list[str] = []
        self.endpoints: dict[str, str] = {}
        self._thread = threading.Thread(target=self._read, args=(process,), daemon=True)
        self._thread.start()

    def _read(self, process: subprocess.Popen[str]) -> None:
        assert process.stdout is not None
        for line in process.stdout:
            line = line.rstrip("\n")
            self.lines.append(line)
            match = ENDPOINT.match(line)
            if match:
                self.endpoints[match.group(1)] = match.group(2)
        process.stdout.close()

    def text(self) -> str:
        self._thread.join(10)
        return "\n".join(self.lines)


def publish_when_routable(broker: Broker, exchange: str, key: str, body: bytes) -> None:
    """The roles declare the queues as they start; publish once a queue is bound."""

    def sent() -> bool:
        try:
            broker.publish(exchange, key, body)
        except UnroutableError:
            return False
        return True

    wait_for(f"a queue bound to {exchange}/{key}", sent, 120)


def poison(settings: Settings, job: str) -> None:
    """One undecodable message on each consumer's queue: every role dead-letters one."""
    broker = Backends(settings.broker, settings.store).open_broker("pytest-poison")
    try:
        publish_when_routable(broker, SMASHED_EXCHANGE, shard_routing_key(job, 0), b"junk")
        publish_when_routable(broker, CONTROL_EXCHANGE, updates_routing_key(job), b"junk")
        publish_when_routable(broker, CONTROL_EXCHANGE, job, b"junk")
    finally:
        broker.close()


def label_values(samples: Samples, name: str, label: str) -> set[str]:
    return {v for (n, labels), _ in samples.items() if n == name for k, v in labels if k == label}


@pytest.mark.timeout(600)
def test_every_role_serves_its_metrics_during_a_run(config: Path, tmp_path: Path, job: str) -> None:
    settings = load_settings(config, {"SPLITMQ_JOB__NAME": job})
    runs = tmp_path / "runs"
    up = [sys.executable, "-m", "services.cli.main", "up", str(config), "--timeout", "400"]
    up += ["--workers", "2", "--clients", "3", "--report-dir", str(runs)]
    process = subprocess.Popen(
        up, env=child_env(job), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    output = Output(process)
    scraped: dict[str, tuple[str, Samples]] = {}
    # Most client members each role reported in any scrape: the last scrape may fall after
    # the final round, when clients are already leaving (a 3-round job on a loaded host).
    peak_clients: dict[str, float] = {}
    try:
        wait_for("every role's endpoint", lambda: set(ROLES) <= set(output.endpoints), 240)
        poison(settings, job)

        def busy_everywhere() -> bool:
            for role in ROLES:
                scraped[role] = scrape(output.endpoints[role] + "/metrics")
                members = total(scraped[role][1], "splitmq_members", kind="client")
                peak_clients[role] = max(peak_clients.get(role, 0.0), members)
            workers = [scraped[w][1] for w in ("worker-0", "worker-1")]
            aggregator = scraped["aggregator"][1]
            return (
                sum(total(w, "splitmq_samples_total") for w in workers) > 0
                and sum(total(w, "splitmq_dead_lettered_total") for w in workers) > 0
                and total(aggregator, "splitmq_samples_total") > 0
                and total(aggregator, "splitmq_dead_lettered_total") > 0
            )

        # While the job trains: the roles are still up, so this is a scrape of a live run.
        wait_for("trained samples and dead letters on the endpoints", busy_everywhere, 300, 1.0)
        dashboard = state(output.endpoints["coordinator"])
    finally:
        try:
            process.wait(420)
        finally:
            if process.poll() is None:
                process.kill()
    text = output.text()
    assert process.returncode == 0, text[-6000:]

    for role in ROLES:
        exposition, _ = scraped[role]
        assert missing(exposition) == [], role
    workers = [scraped[w][1] for w in ("worker-0", "worker-1")]
    aggregator = scraped["aggregator"][1]
    coordinator = scraped["coordinator"][1]

    def both(name: str, **labels: str) -> float:
        return sum(total(w, name, **labels) for w in workers)

    for name in (
        "splitmq_samples_total",
        "splitmq_step_latency_seconds_count",
        "splitmq_staleness_versions_count",
        "splitmq_bytes_in_total",
        "splitmq_bytes_out_total",
        "splitmq_busy_fraction",
    ):
        assert both(name) > 0, name
    assert both("splitmq_dead_lettered_total", reason="decode") == 1
    assert max(total(w, "splitmq_members", kind="worker") for w in workers) == 2
    assert max(total(w, "splitmq_version") for w in workers) >= 1
    assert set().union(*(label_values(w, "splitmq_queue_depth", "shard") for w in workers)) == {
        "0",
        "1",
    }

    assert total(aggregator, "splitmq_samples_total") > 0
    assert total(aggregator, "splitmq_version") >= 2  # it counted a trained version's samples
    assert total(aggregator, "splitmq_staleness_versions_count") > 0
    assert total(aggregator, "splitmq_dead_lettered_total", reason="undecodable") == 1
    assert total(coordinator, "splitmq_dead_lettered_total", reason="undecodable") == 1
    for samples in (aggregator, coordinator):
        assert total(samples, "splitmq_bytes_in_total") > 0
        assert total(samples, "splitmq_bytes_out_total") > 0
        assert total(samples, "splitmq_busy_fraction") > 0
        assert total(samples, "splitmq_version") >= 1
        assert label_values(samples, "splitmq_queue_depth", "shard") == {"0", "1"}
    assert peak_clients["aggregator"] == peak_clients["coordinator"] == 3, peak_clients

    # The coordinator's dashboard followed the run: members joined, versions with accuracy.
    assert dashboard["members"]["joined"] == 3
    assert dashboard["versions"] and dashboard["versions"][0]["global_accuracy"] > 0
    assert "dashboard: http://" in text

    # `up` itself: every role's output under its name, a finished run directory, and the
    # aggregator's summary as the last thing it prints.
    assert "did not stop cleanly" not in text
    for name in ("aggregator", "coordinator", "worker-0", "worker-1", "client-0", "client-2"):
        assert f"\n{name:<11} | " in text, name
    # Its thread budget: two workers and three clients compute at once on this host's cores,
    # so each child runs torch on a fifth of them, says so, and the report records it.
    cores = usable_cores()
    share = max(1, cores // 5)
    rule = f"auto: {cores} cores shared by 5 compute threads"
    said = f"torch threads: {share} intra-op / {share} inter-op ({rule})"
    lines = text.splitlines()
    for name in ("aggregator", "coordinator", "worker-0", "worker-1", "client-0", "client-2"):
        assert any(line.startswith(f"{name} ") and said in line for line in lines), name
    assert "in effect" not in text  # torch runs with the budget it was given
    (run_dir,) = runs.iterdir()
    assert run_dir.name.startswith(f"{job}-")
    doc = json.loads((run_dir / "metrics.json").read_text())
    assert doc["run"]["status"] == "finished"
    assert doc["run"]["torch_threads"] == doc["run"]["torch_interop_threads"] == share
    assert doc["run"]["thread_budget"] == rule
    assert doc["run"]["command"].startswith("splitmq aggregator")
    assert [r["version"] for r in doc["records"]] == [2, 3, 4]
    assert all(r["participants"] == 3 for r in doc["records"])
    assert doc["records"][-1]["global_accuracy"] > 0.1
    summary = (run_dir / "summary.txt").read_text()
    # The summary, then where the trained model was written (services/report/final_model.py).
    assert summary.rstrip() in text
    assert text.rstrip().endswith("model.safetensors")
    assert 'kind = "rabbitmq"' in (run_dir / "config.toml").read_text()


@pytest.mark.timeout(200)
def test_dashboard_command_reports_the_real_queue_depth(config: Path, job: str) -> None:
    settings = load_settings(config, {"SPLITMQ_JOB__NAME": job})
    cmd = [sys.executable, "-m", "services.cli.main", "dashboard", str(config)]
    process = subprocess.Popen(
        cmd, env=child_env(job), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    output = Output(process)
    broker = Backends(settings.broker, settings.store).open_broker("pytest-depth")
    try:
        pattern = re.compile(r"^metrics: (http://\S+)/metrics$")

        def url() -> str:
            found = [m.group(1) for line in output.lines if (m := pattern.match(line))]
            return found[0] if found else ""

        wait_for("the dashboard's endpoint", lambda: bool(url()), 120)
        # Nobody consumes this job's shard 1: what goes in stays, and the gauge must say so.
        for _ in range(7):
            publish_when_routable(broker, SMASHED_EXCHANGE, shard_routing_key(job, 1), b"x")

        def seven() -> bool:
            return total(scrape(url() + "/metrics")[1], "splitmq_queue_depth", shard="1") == 7

        wait_for("shard 1's depth of 7", seven, 60)
        snapshot = state(url())
        assert snapshot["series"]["queue.1"][-1] == 7
    finally:
        broker.close()
        process.terminate()
        process.wait(30)
    assert process.returncode == 0, output.text()[-3000:]
