"""An embedded run keeps its schedule record (issue 36): `run_embedded` with a run directory
writes `schedule.jsonl.gz`, whose folds are exactly the versions the run published, each with
the digest of the weights published, and whose joins are its clients'."""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import pytest

from services.common.backends import Backends, Embedded
from services.common.schedule import (
    AGGREGATOR_STREAM,
    COORDINATOR_STREAM,
    Folded,
    MemberEvent,
    weights_digest,
)
from services.common.schedule_file import SCHEDULE_FILE, read_schedule_file
from services.config.root import Settings
from services.report.records import ListSink
from services.runtime.embedded import run_embedded


def tiny(job: str, mode: str) -> Settings:
    return Settings.model_validate(
        {
            "job": {"name": job, "rounds": 2, "seed": 5},
            "data": {"dataset": "fashion_mnist_sample", "eval_samples": 64},
            "algorithm": {"name": "sfl_v2", "batch_size": 16, "max_steps_per_round": 2},
            "clients": {"count": 2, "heartbeat_s": 0.5},
            "rounds": {"mode": mode},
            "asynchronous": {"buffer_size": 2},
        }
    )


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_an_embedded_run_writes_its_schedule(
    job: str, mode: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    settings = tiny(job, mode)
    embedded = Embedded()
    backends = Backends(settings.broker, settings.store, embedded)
    with caplog.at_level(logging.INFO, logger="splitmq.runtime"):
        outcome = run_embedded(
            settings, sink=ListSink(), stop=threading.Event(), backends=backends, run_dir=tmp_path
        )
    assert outcome.status == "finished"

    schedule = read_schedule_file(tmp_path / SCHEDULE_FILE)
    header = schedule.header
    assert (header.job, header.seed, header.mode, header.deterministic) == (job, 5, mode, True)
    assert header.torch_threads >= 1
    store = embedded.store
    published = store.versions(job)
    folds = [e for e in schedule.streams[AGGREGATOR_STREAM] if isinstance(e, Folded)]
    assert [f.version for f in folds] == [v for v in published if v > 1] == [2, 3]
    for f in folds:
        blobs = {
            r: store.read_blob(job, f.version, r) for r in store.manifest(job, f.version).entries
        }
        assert f.digest == weights_digest(blobs)
        assert (
            sorted(u.client for u in f.updates) == [u.client for u in f.updates] or mode == "async"
        )
        # Sync: the one shard's replica each round; async: when it has fresh progress.
        assert [shard for shard, _ in f.replicas] == [0] or (mode == "async" and not f.replicas)
    events = [e for e in schedule.streams[COORDINATOR_STREAM] if isinstance(e, MemberEvent)]
    joins = sorted((e.partition, e.shard) for e in events if e.kind == "join")
    assert joins == [(0, 0), (1, 0)]
    logged = [r.getMessage() for r in caplog.records if "schedule record" in r.getMessage()]
    assert logged == [f"schedule record: {schedule.entries} entries in {tmp_path / SCHEDULE_FILE}"]
