"""`splitmq experiment NAME --quick`: the grid runs end to end and its section is written.

The runs go through the embedded service (the real roles over the in-memory broker and store)
on the full dataset; the results file is a temporary copy, never the real docs/results.md.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from click.testing import CliRunner

from services.cli.main import cli
from services.experiments import minibatch_sfl
from services.experiments.runner import slug

pytestmark = pytest.mark.slow

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
OTHER_SECTION = "<!-- other -->\nsomeone else's numbers\n<!-- /other -->\n"


def final_accuracy(run_dir: Path) -> float:
    doc = json.loads((run_dir / "metrics.json").read_text())
    assert doc["run"]["status"] == "finished"
    return float(doc["records"][-1]["global_accuracy"])


def test_quick_minibatch_sfl_writes_its_section_from_the_runs(
    tmp_path: Path, data_dir: str
) -> None:
    out = tmp_path / "docs" / "results.md"
    out.parent.mkdir()
    out.write_text("# Results\n\n" + OTHER_SECTION)
    runs_dir = tmp_path / "runs"
    args = ["experiment", minibatch_sfl.NAME, "--quick", "--data-dir", data_dir]
    args += ["--out", str(out), "--runs-dir", str(runs_dir)]
    result = CliRunner().invoke(cli, args, env={"SPLITMQ_DATA_DIR": None})
    assert result.exit_code == 0, result.output
    assert "[4/4] centralized" in result.output  # progress, one line per run and round
    assert "round 2/2" in result.output

    text = out.read_text()
    assert OTHER_SECTION in text  # another experiment's section is left alone
    section = text.split("<!-- minibatch_sfl -->")[1].split("<!-- /minibatch_sfl -->")[0]
    assert "Smoke run" in section and "24.1" in section  # the paper's claim beside ours
    assert "splitmq experiment minibatch_sfl --quick" in section

    # The table's numbers are the runs' own final accuracies, read from their report dirs.
    quick_runs = minibatch_sfl.build().quick_runs
    finals = {
        run.tags["algorithm"]: final_accuracy(runs_dir / minibatch_sfl.NAME / slug(run.label))
        for run in quick_runs
    }
    row = next(ln for ln in section.splitlines() if ln.startswith("| 0.95 | block1 |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    order = [minibatch_sfl.MBSFL, minibatch_sfl.SFL, minibatch_sfl.FL, minibatch_sfl.CENTRAL]
    assert cells[2:6] == [f"{100 * finals[a]:.1f}" for a in order]
    gain = 100 * (finals[minibatch_sfl.MBSFL] - finals[minibatch_sfl.SFL])
    assert cells[6] == f"{gain:+.1f}"
    assert finals[minibatch_sfl.CENTRAL] > 0.3  # it learned (chance is 0.1)

    # Every run has its wall time; every linked figure exists and is a PNG.
    for run in quick_runs:
        assert re.search(rf"\| `{re.escape(run.label)}` \|.*\| finished \| 2/2 \|", section)
    figures = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", section)
    assert figures, section
    for relative in figures:
        path = out.parent / relative
        assert path.read_bytes()[:8] == PNG_MAGIC
        assert path.parent == out.parent / "results"


def test_seeds_run_each_configuration_again_and_the_table_shows_the_spread(
    tmp_path: Path, data_dir: str
) -> None:
    """Two seeds of the in-process baseline (the cheapest run): two report directories with
    their own job.seed, different numbers, both listed, and the section says so (the tables'
    `mean ± std` cells: tests/unit/test_experiment_seeds.py)."""
    out = tmp_path / "results.md"
    runs_dir = tmp_path / "runs"
    args = ["experiment", minibatch_sfl.NAME, "--quick", "--data-dir", data_dir, "--seeds", "2"]
    args += ["--only", "centralized*", "--out", str(out), "--runs-dir", str(runs_dir)]
    result = CliRunner().invoke(cli, args, env={"SPLITMQ_DATA_DIR": None})
    assert result.exit_code == 0, result.output
    (run,) = [r for r in minibatch_sfl.build().quick_runs if r.label.startswith("centralized")]
    first = runs_dir / minibatch_sfl.NAME / slug(run.label)
    (second,) = (runs_dir / minibatch_sfl.NAME).glob(f"{slug(run.label)}-seed*")
    seeds = [
        json.loads((d / "experiment.json").read_text())["config"]["job"]["seed"]
        for d in (first, second)
    ]
    assert seeds[1] == seeds[0] + 1
    finals = [final_accuracy(d) for d in (first, second)]
    assert finals[0] != finals[1]  # another seed, another model and data order
    section = out.read_text()
    assert "**Seeds.** 2 per configuration" in section
    rows = [ln for ln in section.splitlines() if ln.startswith(f"| `{run.label}` |")]
    assert [ln.split(" | ")[2] for ln in rows] == [str(seeds[0]), str(seeds[1])]
