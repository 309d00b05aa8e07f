"""`splitmq experiment subfedavg|splitgp --quick`: the grid runs end to end through the embedded
service, every run's last version is evaluated client by client (`final.json`), and the
section's tables hold the numbers recomputed here from the run directories.

The results file is a temporary one, never the real docs/results.md.
"""

from __future__ import annotations

import itertools
import json
import re
from pathlib import Path

import pytest
from click.testing import CliRunner

from services.cli.main import cli
from services.experiments import splitgp, subfedavg
from services.experiments.runner import slug

# Several runs with a final evaluation each: slower than the suite's default budget on a
# shared two-core machine.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def run_quick(name: str, tmp_path: Path, data_dir: str) -> tuple[str, Path]:
    out = tmp_path / "docs" / "results.md"
    runs_dir = tmp_path / "runs"
    args = ["experiment", name, "--quick", "--data-dir", data_dir]
    args += ["--out", str(out), "--runs-dir", str(runs_dir)]
    result = CliRunner().invoke(cli, args, env={"SPLITMQ_DATA_DIR": None})
    assert result.exit_code == 0, result.output
    text = out.read_text()
    section = text.split(f"<!-- {name} -->")[1].split(f"<!-- /{name} -->")[0]
    assert "Smoke run" in section
    figures = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", section)
    assert len(figures) >= 2, section
    for relative in figures:
        assert (out.parent / relative).read_bytes()[:8] == PNG_MAGIC
    return section, runs_dir / name


def cells(section: str, first: str) -> list[str]:
    row = next(ln for ln in section.splitlines() if ln.startswith(f"| {first} |"))
    return [c.strip() for c in row.strip("|").split("|")]


def records(run_dir: Path) -> list[dict[str, object]]:
    doc = json.loads((run_dir / "metrics.json").read_text())
    assert doc["run"]["status"] == "finished"
    return list(doc["records"])


def final(run_dir: Path) -> dict[str, float]:
    return {k: float(v) for k, v in json.loads((run_dir / "final.json").read_text()).items()}


def mean(values: list[float]) -> float:
    return sum(values) / len(values)


def test_quick_subfedavg_reports_every_clients_own_model(tmp_path: Path, data_dir: str) -> None:
    section, runs = run_quick(subfedavg.NAME, tmp_path, data_dir)
    assert "about 20 points above" in section  # the paper's claim beside ours
    labels = {run.tags["method"]: slug(run.label) for run in subfedavg.build().quick_runs}
    sub_method = subfedavg.VARIANTS[1][0]

    # Sub-FedAvg: the mean of each client's last reported local accuracy after pruning.
    last: dict[str, float] = {}
    reduction: dict[str, float] = {}
    for rec in records(runs / labels[sub_method]):
        extra = rec["extra"]
        assert isinstance(extra, dict)
        for key, value in extra.items():
            if key.startswith("local_accuracy."):
                last[key.split(".", 1)[1]] = value
            if key.startswith("param_reduction."):
                reduction[key.split(".", 1)[1]] = value
    assert last and max(reduction.values()) > 0  # clients pruned
    sub = mean(list(last.values()))

    # FedAvg: the final global model on every client's local test set (10 clients).
    fedavg = final(runs / labels[subfedavg.FEDAVG])
    fedavg_local = [v for k, v in fedavg.items() if k.startswith("local.")]
    assert len(fedavg_local) == 10
    # Standalone: only clients that trained a model of their own.
    standalone = final(runs / labels[subfedavg.STANDALONE])
    clients = [k.split(".", 1)[1] for k in standalone if k.startswith("local.")]
    own = [standalone[f"local.{c}"] for c in clients if standalone[f"own.{c}"] == 1.0]
    assert 0 < len(own) < 10  # half the clients per round, two rounds
    row = cells(section, sub_method)
    assert row[1] == f"{100 * sub:.1f}"
    assert row[2] == f"{100 * (sub - mean(own)):+.1f}"
    assert row[3] == f"{100 * (sub - mean(fedavg_local)):+.1f}"
    assert row[4] == f"{100 * mean(list(reduction.values())):.1f}"
    assert cells(section, subfedavg.FEDAVG)[1] == f"{100 * mean(fedavg_local):.1f}"


def test_quick_splitgp_reports_accuracy_against_p(tmp_path: Path, data_dir: str) -> None:
    section, runs = run_quick(splitgp.NAME, tmp_path, data_dir)
    labels = {run.tags["method"]: slug(run.label) for run in splitgp.build().quick_runs}

    ours = final(runs / labels[splitgp.SPLITGP])
    # Split inference at E_th: the table's p = 0 and p = 1 columns are its local and ood rates.
    row = cells(section, splitgp.SPLITGP)
    assert row[1] == f"{100 * ours['splitgp.split_local']:.1f}"
    assert row[-1] == f"{100 * ours['splitgp.split_ood']:.1f}"
    p04 = 0.6 * ours["splitgp.split_local"] + 0.4 * ours["splitgp.split_ood"]
    assert row[3] == f"{100 * p04:.1f}"
    # The sweep's offloaded share: every row at E_th = 0 (no softmax has zero entropy), none
    # above ln 10, and never more rows at a larger threshold.
    offloaded = [ours[f"splitgp.sweep.{t:g}.offload_local"] for t in splitgp.SWEEP]
    assert offloaded[0] == 1.0 and offloaded[-1] == 0.0
    assert all(a >= b for a, b in itertools.pairwise(offloaded))

    local = final(runs / labels[splitgp.LOCAL])
    row = cells(section, splitgp.LOCAL)
    assert row[1] == f"{100 * local['full_local']:.1f}"
    # A local-only model never saw the other classes.
    assert local["full_ood"] < 0.05
    assert "SplitGP's E_th sweep" in section
