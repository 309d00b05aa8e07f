"""The dashboard's state: events, probes and the run directory into one JSON snapshot."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from broker.messages import Event
from broker.store import Member
from services.common.leases import WorkerBeat
from services.dashboard.state import DashboardState, Probe, state_json
from services.dashboard.watch import find_run_dir, read_report, split_members
from services.report.tables import finite


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def event(kind: str, version: int, client: str = "", **data: object) -> Event:
    return Event("job", client, f"m-{kind}-{version}-{client}", version, kind, dict(data))


def probe(at: float, version: int, samples: dict[str, int], depths: dict[int, int]) -> Probe:
    workers = [WorkerBeat(w, (0,), 0.5, n) for w, n in samples.items()]
    return Probe(at, version, ["c-0", "c-1"], workers, depths)


def test_events_make_the_timeline_and_the_accuracy_curve() -> None:
    clock = Clock()
    state = DashboardState("job", {"algorithm": "sfl"}, clock=clock)
    state.on_event(event("member_joined", 1, "c-0", shard=0, samples=100), 1001.0)
    state.on_event(event("member_joined", 1, "c-1", shard=0, samples=100), 1001.5)
    state.on_event(event("version_published", 2, round=0, global_accuracy=0.5), 1004.0)
    state.on_event(event("version_published", 3, round=1, global_accuracy=0.7), 1006.0)
    state.on_event(event("member_left", 3, "c-1", reason="expired"), 1007.0)
    other = Event("other-job", "", "m", 9, "version_published", {"global_accuracy": 0.1})
    state.on_event(other, 1007.0)
    snap = state.snapshot()
    assert snap["members"] == {"joined": 2, "left": 1}
    assert [v["version"] for v in snap["versions"]] == [2, 3]
    assert [v["global_accuracy"] for v in snap["versions"]] == [0.5, 0.7]
    assert snap["versions"][0]["t"] == pytest.approx(4.0)
    assert snap["events"][0]["kind"] == "member_left"  # newest first
    assert snap["status"] == "running"
    state.on_event(event("job_finished", 3, rounds=2), 1008.0)
    assert state.snapshot()["status"] == "finished"


def test_a_failed_job_shows_as_failed_with_its_reason() -> None:
    state = DashboardState("job", clock=Clock())
    state.on_event(event("version_published", 2, round=0, global_accuracy=0.5), 1002.0)
    reason = "3 consecutive attempts at round 1 without one valid update; non_finite ×4"
    state.on_event(event("job_finished", 2, rounds=5, status=f"failed: {reason}"), 1009.0)
    snap = state.snapshot()
    assert snap["status"] == f"failed: {reason}"
    assert snap["finished"] == {"t": pytest.approx(9.0), "version": 2, "status": snap["status"]}


def test_a_dashboard_started_after_the_end_reads_it_from_the_store() -> None:
    state = DashboardState("job", clock=Clock())
    state.on_probe(probe(1001.0, 3, {}, {}))
    assert state.snapshot()["status"] == "running"
    ended = Probe(1002.0, 3, [], [], {}, ended="failed: diverged")
    state.on_probe(ended)
    assert state.snapshot()["status"] == "failed: diverged"


def test_probes_make_series_and_throughput_from_worker_counters() -> None:
    clock = Clock()
    state = DashboardState("job", clock=clock)
    state.on_probe(probe(1001.0, 1, {"w0": 0}, {0: 0}))
    state.on_probe(probe(1003.0, 1, {"w0": 400}, {0: 5}))
    # A second shard appears later; a worker restarts and counts from zero.
    state.on_probe(probe(1005.0, 2, {"w0": 800, "w1": 200}, {0: 2, 1: 7}))
    state.on_probe(probe(1007.0, 2, {"w0": 100, "w1": 400}, {0: 0, 1: 1}))
    series = state.snapshot()["series"]
    assert series["t"] == pytest.approx([1.0, 3.0, 5.0, 7.0])
    assert series["version"] == [1.0, 1.0, 2.0, 2.0]
    assert series["clients"] == [2.0] * 4
    assert series["queue.0"] == [0.0, 5.0, 2.0, 0.0]
    assert series["queue.1"] == [None, None, 7.0, 1.0]
    # trained: 0, 400, 1000 (+400 w0, +200 w1), 1300 (+100 restarted w0, +200 w1)
    assert series["throughput"][0] is None
    assert series["throughput"][1] == pytest.approx(400 / 2)
    assert series["throughput"][3] == pytest.approx(1300 / 6)


def test_run_report_fills_versions_and_final_status(tmp_path: Path) -> None:
    run = tmp_path / "job-20260101-120000"
    run.mkdir()
    records = [
        {"version": 2, "round": 0, "global_accuracy": 0.6, "samples_per_s": 900.0},
        {"version": 3, "round": 1, "global_accuracy": None, "samples_per_s": 950.0},
    ]
    (run / "metrics.json").write_text(
        json.dumps({"run": {"status": "finished"}, "records": records})
    )
    (run / "summary.txt").write_text("final global accuracy 60%\n")
    assert find_run_dir(tmp_path, "job", since=0) == run
    assert find_run_dir(tmp_path, "jo", since=0) is None  # another job's name prefix
    assert find_run_dir(tmp_path, "job", since=4e9) is None  # older than the watch
    report = read_report(run)
    assert report is not None
    state = DashboardState("job")
    state.on_report(report)
    snap = json.loads(state_json(state))
    assert snap["status"] == "finished"
    assert snap["report"]["summary"].startswith("final global accuracy")
    assert [(v["version"], v["samples_per_s"]) for v in snap["versions"]] == [
        (2, 900.0),
        (3, 950.0),
    ]
    assert read_report(tmp_path / "missing") is None


def test_members_split_into_clients_and_workers_with_heartbeat_info() -> None:
    members = {
        "client:c-1": Member("client:c-1", 0.0, {"shard": "0"}),
        "worker:w-0": Member(
            "worker:w-0", 0.0, {"shards": "0,1", "busy": "0.25", "samples": "64", "metrics": "u"}
        ),
        "worker:w-1": Member("worker:w-1", 0.0, {"shards": "", "busy": "?"}),
    }
    clients, workers = split_members(members)
    assert clients == ["c-1"]
    assert workers == [
        WorkerBeat("w-0", (0, 1), 0.25, 64, "u"),
        WorkerBeat("w-1", (), None, None, ""),
    ]


def test_snapshot_json_has_no_nan() -> None:
    assert finite({"a": [float("nan"), 1.0, float("inf")]}) == {"a": [None, 1.0, None]}
