"""The embedded runner's /metrics during a real (short) run: every listed metric is there and
non-zero where the run makes it so, dead letters by reason, queue depth from the real queue.

"During" is made certain, not hoped for: the sink holds the aggregator inside `record` of one
version, so the job cannot finish while the test pokes and scrapes (a short run on a loaded
machine used to end first, leaving the poisoned update unconsumed).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from broker.topology import (
    CONTROL_EXCHANGE,
    SMASHED_EXCHANGE,
    shard_routing_key,
    updates_routing_key,
)
from services.common.backends import Backends, Embedded
from services.common.supervise import Outcome
from services.config.loading import load_settings
from services.report.records import ListSink, VersionRecord
from services.runtime.embedded import run_embedded
from services.runtime.observe import observed
from tests.integration.scrape import missing, scrape, total, wait_for

pytestmark = pytest.mark.slow

CONFIG = """
[job]
name = "metrics-embedded"
rounds = 3

[data]
eval_samples = 200

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

[workers]
count = 2

[metrics]
port = 0
probe_s = 0.3
"""


# The run is held after its second version (of three): one round is still to run.
HOLD_AT = 2


@dataclass
class HoldingSink(ListSink):
    """Keeps the records, and holds the aggregator inside the `hold_at`-th one until `resume`
    is set. The aggregator calls `record` before it opens the next round, so while it is held
    the job cannot end and no assignment of the next round has gone out."""

    hold_at: int = HOLD_AT
    held: threading.Event = field(default_factory=threading.Event)
    resume: threading.Event = field(default_factory=threading.Event)

    def record(self, record: VersionRecord) -> None:
        super().record(record)
        if len(self.records) == self.hold_at:
            self.held.set()
            # Bounded: a test that never resumes (it failed) must not leave the run hanging.
            self.resume.wait(120)


@pytest.mark.timeout(300)
def test_embedded_run_serves_every_metric(tmp_path: Path) -> None:
    path = tmp_path / "job.toml"
    path.write_text(CONFIG)
    settings = load_settings(path, {})
    job = settings.job.name
    backends = Backends(settings.broker, settings.store, Embedded())
    printed: list[str] = []
    sink = HoldingSink()
    outcome: list[Outcome] = []
    with observed(settings, "run", backends, echo=printed.append, watch=True) as seen:
        assert seen.url and printed == [f"metrics: {seen.url}/metrics"]
        url = seen.url + "/metrics"
        stop = threading.Event()

        def run() -> None:
            outcome.append(run_embedded(settings, sink=sink, stop=stop, backends=seen.backends))

        runner = threading.Thread(target=run)
        runner.start()
        poke = backends.open_broker()
        try:
            assert sink.held.wait(180), "the run never published its second version"
            assert runner.is_alive() and not outcome
            # Poison one smashed batch and one update: both consumers dead-letter them. The
            # workers consume while the aggregator is held. The update queues ahead of every
            # update of the last round (not assigned yet), and that round only closes on an
            # update it accepted, so the aggregator must judge the poison before the job ends.
            poke.publish(SMASHED_EXCHANGE, shard_routing_key(job, 0), b"not msgpack")
            poke.publish(CONTROL_EXCHANGE, updates_routing_key(job), b"not an update")

            def worker_dead_lettered() -> bool:
                _, samples = scrape(url)
                return total(samples, "splitmq_dead_lettered_total", role="worker") > 0

            wait_for("the worker's dead letter", worker_dead_lettered, 60)
            text, mid = scrape(url)
        finally:
            sink.resume.set()
            runner.join(240)
        assert outcome and outcome[0].ok, outcome
        assert missing(text) == []
        worker = {"role": "worker"}
        for name in (
            "splitmq_samples_total",
            "splitmq_step_latency_seconds_count",
            "splitmq_staleness_versions_count",
            "splitmq_bytes_in_total",
            "splitmq_bytes_out_total",
        ):
            assert total(mid, name, **worker) > 0, name
        assert 0 < total(mid, "splitmq_busy_fraction", **worker) <= 2.0  # two workers
        assert total(mid, "splitmq_version") >= 2
        assert total(mid, "splitmq_members", kind="client") == 3
        assert total(mid, "splitmq_members", kind="worker") == 2
        assert {("shard", "0"), ("shard", "1")} <= {
            label
            for (name, labels), _ in mid.items()
            if name == "splitmq_queue_depth"
            for label in labels
        }

        # After the run the counters hold the whole run's work.
        _, end = scrape(url)
        trained_by_workers = total(end, "splitmq_samples_total", role="worker")
        aggregated = total(end, "splitmq_samples_total", role="aggregator")
        assert aggregated == sum(r.samples for r in sink.records)
        assert trained_by_workers >= aggregated > 0
        assert total(end, "splitmq_version") == settings.job.rounds + 1
        assert total(end, "splitmq_staleness_versions_count", role="aggregator") >= 3 * 3
        assert total(end, "splitmq_dead_lettered_total", role="worker", reason="decode") == 1
        assert (
            total(end, "splitmq_dead_lettered_total", role="aggregator", reason="undecodable") == 1
        )

        # Queue depth is the real queue's: nobody consumes shard 1 any more.
        for _ in range(5):
            poke.publish(SMASHED_EXCHANGE, shard_routing_key(job, 1), b"left behind")

        def depth() -> bool:
            _, now = scrape(url)
            return total(now, "splitmq_queue_depth", shard="1") >= 5

        wait_for("shard 1's depth", depth, 30)
        poke.close()
