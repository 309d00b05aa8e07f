"""Async mode embedded: the real roles on threads over the in-memory broker and store, with
one client joining late and one leaving early. The job learns, each version folds K updates,
and the report carries the staleness histogram."""

from __future__ import annotations

import json
import logging
import threading
from pathlib import Path

import pytest

from benchmarks.churn import Churn, churn_roles
from services.common.backends import Backends, Embedded
from services.common.membership import member_id
from services.config.loading import load_settings
from services.report.filesink import FileSink
from services.report.plots import STALENESS_PNG
from services.runtime.embedded import run_embedded

pytestmark = pytest.mark.slow

VERSIONS = 8
K = 2
LATE, LEAVER = 3, 0

CONFIG = """
[job]
name = "asyncemb"
rounds = {versions}
seed = 3

[data]
dataset = "fashion_mnist_sample"
eval_samples = 500

[algorithm]
name = "sfl_v2"
batch_size = 32
lr = 0.05
momentum = 0.9
max_steps_per_round = 8

[clients]
count = 4
heartbeat_s = 0.5

[rounds]
mode = "async"

[asynchronous]
buffer_size = {k}
max_staleness = 3
worker_max_staleness = 3

[workers]
checkpoint_every_steps = 10

[report]
dir = "{runs}"
"""


def test_an_async_run_with_churn_learns_and_reports_its_staleness(tmp_path: Path) -> None:
    path = tmp_path / "async.toml"
    path.write_text(CONFIG.format(versions=VERSIONS, k=K, runs=tmp_path / "runs"))
    settings = load_settings(path, {})
    embedded = Embedded()
    backends = Backends(settings.broker, settings.store, embedded)
    store = embedded.store
    job = settings.job.name

    def at_version(v: int) -> bool:
        return store.current_version(job) >= v

    # The late client joins once version 3 is out; client 0 leaves once version 4 is.
    plan = {
        LATE: Churn(join=lambda: lambda: at_version(3)),
        LEAVER: Churn(leave=lambda: lambda: at_version(4)),
    }
    left_at: list[int] = []

    def watch_leave(stop: threading.Event) -> None:
        while not stop.wait(0.05):
            if member_id(f"client-{LEAVER}") not in store.live_members(job) and at_version(4):
                left_at.append(store.current_version(job))
                return

    sink = FileSink.create(settings, command="test")
    stop = threading.Event()
    watcher = threading.Thread(target=watch_leave, args=(stop,), daemon=True)
    watcher.start()
    outcome = run_embedded(
        settings,
        sink=sink,
        stop=stop,
        build_roles=churn_roles(plan),
        backends=backends,
        logger=logging.getLogger("test.async.embedded"),
    )
    stop.set()
    watcher.join(5)

    assert outcome.status == "finished", outcome.traceback
    records = sink.records
    assert [r.version for r in records] == list(range(2, VERSIONS + 2))
    assert all(r.participants == K for r in records)
    assert records[-1].global_accuracy > 0.5, [r.global_accuracy for r in records]
    by_version = {
        v: store.manifest(job, v).meta["participants"].split(",")
        for v in store.versions(job)
        if v > 1
    }
    late = [v for v, who in by_version.items() if f"client-{LATE}" in who]
    assert late and min(late) >= 4, by_version  # it existed only from version 3 on
    assert left_at, "the leaving client was never seen to leave"
    after_leave = [v for v, who in by_version.items() if v > left_at[0] + 1]
    assert all(f"client-{LEAVER}" not in by_version[v] for v in after_leave), by_version

    doc = json.loads((sink.run_dir / "metrics.json").read_text())
    assert doc["run"]["status"] == "finished"
    folded = sum(
        value
        for r in doc["records"]
        for key, value in r["extra"].items()
        if key.startswith("staleness.") and key[len("staleness.") :].isdigit()
    )
    assert folded == K * VERSIONS
    assert (sink.run_dir / STALENESS_PNG).stat().st_size > 0
    assert "staleness (async)" in (sink.run_dir / "summary.txt").read_text()
