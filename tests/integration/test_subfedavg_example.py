"""examples/subfedavg.toml as `splitmq run` runs it (embedded, on the shipped sample), and the
paper's Standalone baseline on the same clients."""

from __future__ import annotations

import csv
import json
import threading
from pathlib import Path

import pytest

from services.config.loading import load_settings
from services.report.filesink import FileSink
from services.runtime.embedded import run_embedded
from tests.unit.test_worker_support import one_torch_thread

__all__ = ["one_torch_thread"]  # the autouse fixture, imported so that it applies here

pytestmark = pytest.mark.slow

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "subfedavg.toml"


def run_example(tmp_path: Path, **env: str) -> tuple[dict[str, object], Path]:
    overrides = {"SPLITMQ_REPORT__DIR": str(tmp_path / "runs"), **env}
    settings = load_settings(EXAMPLE, overrides)
    sink = FileSink.create(settings, command="test")
    outcome = run_embedded(settings, sink=sink, stop=threading.Event())
    assert outcome.ok, f"{outcome.status}\n{outcome.traceback}"
    doc: dict[str, object] = json.loads((sink.run_dir / "metrics.json").read_text())
    return doc, sink.run_dir


@pytest.mark.timeout(240)
def test_the_example_learns_personalised_subnetworks_and_reports_the_reductions(
    tmp_path: Path,
) -> None:
    doc, run_dir = run_example(tmp_path)
    records = doc["records"]
    assert isinstance(records, list) and len(records) == 6
    last = records[-1]
    # Ten-way models judged on each client's two labels (chance: about 0.1).
    assert last["personal_accuracy"] > 0.8, [r["personal_accuracy"] for r in records]
    assert last["extra"]["local_accuracy"] > 0.8
    # 20% of the alive weights per adoption, towards a 50% target.
    assert 0.2 <= last["extra"]["param_reduction"] <= 0.5 + 1e-6
    assert last["extra"]["flop_reduction"] > 0.15
    with (run_dir / "metrics.csv").open() as f:
        header = next(csv.reader(f))
    per_client = [h for h in header if h.startswith("extra.param_reduction.client-")]
    assert len(per_client) >= 5  # half of the ten clients take part in each round
    assert any(h.startswith("extra.flop_reduction.client-") for h in header)


@pytest.mark.timeout(240)
def test_standalone_keeps_each_clients_own_model(tmp_path: Path) -> None:
    doc, _ = run_example(tmp_path, SPLITMQ_ALGORITHM__NAME="standalone", SPLITMQ_JOB__ROUNDS="2")
    records = doc["records"]
    assert isinstance(records, list) and len(records) == 2
    # Nothing is averaged: the global model stays the seeded one...
    assert records[0]["global_accuracy"] == records[1]["global_accuracy"]
    # ...while each client's own model learns its two labels.
    assert records[-1]["personal_accuracy"] > 0.8
