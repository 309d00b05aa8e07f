"""Going on with a stopped run (services/report/resume.py, version_file.py, the resumed round):
the kept version round-trips into a fresh store, the run's config is checked, the metrics rows
after the resumed version go, the elapsed axis continues, and the first round a resumed
aggregator opens waits for `min_to_start` clients."""

from __future__ import annotations

import json
import logging
import threading
import tomllib
from pathlib import Path

import pytest
import torch

from broker.errors import EncodeError, StoreError
from broker.memory_store import InMemoryWeightStore
from broker.store import (
    AUX_PART,
    CLIENT_PART,
    NO_VERSION,
    SERVER_PART,
    BlobRef,
    Member,
    MemberKind,
)
from services.aggregator.aggregator import Aggregator
from services.common.backends import Backends, Embedded
from services.config.root import Settings
from services.report.filesink import FileSink
from services.report.records import ListSink
from services.report.resume import (
    ResumeError,
    check_config,
    config_differences,
    prepare_resume,
    saved_version,
)
from services.report.rundir import CONFIG_FILE, METRICS_JSON
from services.report.sinks import Continued
from services.report.version_file import VERSION_FILE, VersionKeeper, load_version, save_version
from services.runtime.processes import reset_for_resume
from tests.unit.test_aggregator import SAMPLES, Job
from tests.unit.test_aggregator_peers import add_member, make_settings
from tests.unit.test_report import make_record, settings_in

LOG = logging.getLogger("test.resume")

BLOBS = {
    BlobRef(CLIENT_PART): {"conv.weight": torch.arange(6.0).reshape(2, 3)},
    BlobRef(SERVER_PART): {
        "fc.weight": torch.ones(2, 2),
        "bn.num_batches_tracked": torch.tensor(7),
    },
    BlobRef(AUX_PART, "client-3"): {"head.bias": torch.full((3,), 0.5)},
}


def published(store: InMemoryWeightStore, job: str, versions: int) -> None:
    """`versions` versions of BLOBS, each with its samples and meta."""
    for v in range(versions):
        samples = {BlobRef(CLIENT_PART): 100 + v, BlobRef(SERVER_PART): 50}
        meta = {"round": str(v - 1), "participants": "a,b"}
        store.publish_version(job, v, BLOBS, samples=samples, meta=meta)


def test_a_kept_version_is_published_again_with_its_number_samples_and_meta(
    tmp_path: Path,
) -> None:
    first = InMemoryWeightStore()
    published(first, "j", 3)
    save_version(tmp_path, first, "j", 3)

    saved = load_version(tmp_path / VERSION_FILE)
    fresh = InMemoryWeightStore()
    restored = fresh.restore_version(
        "j", saved.version, saved.blobs, samples=saved.samples, meta=saved.meta
    )
    assert restored == 3

    assert fresh.current_version("j") == 3
    was, now = first.manifest("j", 3), fresh.manifest("j", 3)
    assert now.meta == was.meta == {"round": "1", "participants": "a,b"}
    assert {r: e.samples for r, e in now.entries.items()} == {
        r: e.samples for r, e in was.entries.items()
    }
    for ref, blob in BLOBS.items():
        got = fresh.read_blob("j", 3, ref)
        assert got.keys() == blob.keys()
        for name, tensor in blob.items():
            assert torch.equal(got[name], tensor) and got[name].dtype == tensor.dtype
    # The rounds go on from there: the next publication is version 4.
    assert fresh.publish_version("j", 3, BLOBS) == 4


def test_restoring_is_refused_over_an_existing_version_and_leaves_an_empty_job_empty() -> None:
    store = InMemoryWeightStore()
    published(store, "j", 1)
    with pytest.raises(StoreError, match="has version 1 already"):
        store.restore_version("j", 5, BLOBS)
    empty = InMemoryWeightStore()
    with pytest.raises(EncodeError):
        empty.restore_version("j", 2, {BlobRef(CLIENT_PART): {"x": "not a tensor"}})  # type: ignore[dict-item]
    assert empty.current_version("j") == NO_VERSION


def test_the_keeper_rewrites_the_file_with_each_recorded_version(tmp_path: Path) -> None:
    store = InMemoryWeightStore()
    keeper = VersionKeeper(store, "j", tmp_path, LOG)
    published(store, "j", 2)
    keeper.record(make_record(2, acc=0.5))
    assert load_version(tmp_path / VERSION_FILE).version == 2
    published_more = {BlobRef(CLIENT_PART): {"conv.weight": torch.zeros(2, 3)}}
    store.publish_version("j", 2, published_more)
    keeper.record(make_record(3, acc=0.6))
    saved = load_version(tmp_path / VERSION_FILE)
    assert saved.version == 3
    assert list(saved.blobs) == [BlobRef(CLIENT_PART)]
    assert torch.equal(saved.blobs[BlobRef(CLIENT_PART)]["conv.weight"], torch.zeros(2, 3))


def a_stopped_run(tmp_path: Path, settings: Settings, versions: int) -> Path:
    """A run directory as `splitmq run` leaves it when stopped after `versions` versions."""
    sink = FileSink.create(settings, command="splitmq run x.toml")
    for v in range(2, versions + 1):
        sink.record(make_record(v, acc=0.1 * v))
    sink.finish("stopped")
    return sink.run_dir


def test_a_config_that_changes_what_the_weights_depend_on_is_refused(tmp_path: Path) -> None:
    settings = settings_in(tmp_path)
    run_dir = a_stopped_run(tmp_path, settings, 3)
    saved = tomllib.loads((run_dir / CONFIG_FILE).read_text())
    # More rounds, other deadlines, another data dir, eval cap and report dir: all fine.
    others = settings.model_copy(
        update={
            "job": settings.job.model_copy(update={"rounds": 9}),
            "data": settings.data.model_copy(update={"dir": "/elsewhere", "eval_samples": 5}),
            "rounds": settings.rounds.model_copy(update={"deadline_s": 3.0}),
            "clients": settings.clients.model_copy(update={"heartbeat_ttl_s": 99.0}),
            "workers": settings.workers.model_copy(update={"count": 3}),
        }
    )
    assert config_differences(saved, others) == []
    check_config(run_dir, others)

    changed = settings.model_copy(
        update={
            "model": settings.model.model_copy(update={"cut": "block2"}),
            "job": settings.job.model_copy(update={"seed": 4}),
            "algorithm": settings.algorithm.model_copy(update={"lr": 0.5}),
            "clients": settings.clients.model_copy(update={"count": 7}),
        }
    )
    assert config_differences(saved, changed) == [
        "algorithm.lr = 0.01 in the run, 0.5 now",
        "clients.count = 4 in the run, 7 now",
        "job.seed = 0 in the run, 4 now",
        "model.cut = 'block1' in the run, 'block2' now",
    ]
    with pytest.raises(ResumeError, match=r"model.cut = 'block1' in the run, 'block2' now"):
        check_config(run_dir, changed)
    with pytest.raises(ResumeError, match="not a run directory"):
        check_config(tmp_path, settings)


def test_resuming_drops_the_rows_after_the_version_and_refuses_what_cannot_go_on(
    tmp_path: Path,
) -> None:
    settings = settings_in(tmp_path)  # 3 rounds
    run_dir = a_stopped_run(tmp_path, settings, 3)
    assert [r.version for r in prepare_resume(run_dir, 3, 3, "here")] == [2, 3]
    # A kept version one behind the last row (stopped between the two writes).
    assert [r.version for r in prepare_resume(run_dir, 2, 3, "here", lag=1)] == [2]
    doc = json.loads((run_dir / METRICS_JSON).read_text())
    assert [r["version"] for r in doc["records"]] == [2]

    with pytest.raises(ResumeError, match="no version of the job is left"):
        prepare_resume(run_dir, NO_VERSION, 3, "in Redis")
    with pytest.raises(ResumeError, match="behind the run's last recorded version 2"):
        prepare_resume(run_dir, 1, 3, "in Redis")
    with pytest.raises(ResumeError, match=r"trained all its 3 rounds already.*raise job\.rounds"):
        prepare_resume(run_dir, 4, 3, "in Redis")
    with pytest.raises(ResumeError, match="keeps no version to go on from"):
        saved_version(run_dir, settings)


def test_a_resumed_sink_appends_and_its_time_axis_goes_on(tmp_path: Path) -> None:
    settings = settings_in(tmp_path)
    run_dir = a_stopped_run(tmp_path, settings, 3)  # rows at 10 s and 20 s

    files = FileSink.resume(settings, run_dir, command="splitmq run x.toml --resume r")
    sink = Continued(files, files.elapsed_before_s)
    restarted = make_record(4, acc=0.9)
    sink.record(type(restarted)(**{**restarted.__dict__, "elapsed_s": 1.5}))
    sink.finish("finished")

    doc = json.loads((run_dir / METRICS_JSON).read_text())
    assert [(r["version"], r["elapsed_s"]) for r in doc["records"]] == [
        (2, 10.0),
        (3, 20.0),
        (4, 21.5),
    ]
    assert doc["run"]["status"] == "finished"
    assert doc["run"]["extra"]["resumed_by"] == "splitmq run x.toml --resume r"
    assert "round" in (run_dir / "summary.txt").read_text()


def test_up_resume_clears_the_stopped_processes_but_keeps_versions_and_checkpoints(
    job: str,
) -> None:
    settings = make_settings(job)
    embedded = Embedded()
    backends = Backends(settings.broker, settings.store, embedded)
    store = embedded.store
    published(store, job, 2)
    add_member(store, job, "client-0", samples=10)
    store.heartbeat(job, "worker:worker-0", 60.0, {})

    reset_for_resume(settings, ["client-0"], backends)

    assert store.current_version(job) == 2
    assert store.live_members(job, MemberKind.CLIENT) == {}
    assert store.live_members(job, MemberKind.WORKER) == {}


class CountingStore(InMemoryWeightStore):
    """Says each time the members are read."""

    def __init__(self) -> None:
        super().__init__()
        self.reads = threading.Semaphore(0)

    def live_members(self, job: str, kind: MemberKind | None = None) -> dict[str, Member]:
        found = super().live_members(job, kind)
        self.reads.release()
        return found


def test_the_first_round_of_a_resumed_job_waits_for_min_to_start_clients(job: str) -> None:
    # Resumed at version 2 with one of three clients back: the round must not open with it
    # alone (the others rejoin a moment later and would find the round taken).
    settings = make_settings(job, job={"rounds": 2})
    store = CountingStore()
    j = Job(settings, "abc", store=store, members="a")
    blobs = {ref: j.blob(1, ref) for ref in store.manifest(job, 1).entries}
    store.publish_version(job, 1, blobs)

    def the_others_rejoin() -> None:
        for _ in range(2):  # the round's first read of the members, and one more: it waits
            assert store.reads.acquire(timeout=30)
        for i, c in enumerate("bc", start=1):
            add_member(store, job, c, samples=SAMPLES[c], partition=i, classes=(i,))

    records = j.run(Aggregator(settings, j.backends, sink=ListSink()), during=the_others_rejoin)

    assert [(r.version, r.participants) for r in records] == [(3, 3)]
    assert [set(s.participants) for s in j.worker.starts] == [set("abc")]
