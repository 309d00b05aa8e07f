"""docs/algorithms.md's worked example (a split algorithm in a package of its own,
examples/plugins/median_sfl/) is the code that runs: the doc shows its files verbatim, the
shipped strategy contract passes on it, and its own tests pass from its own folder."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from services.testing import check_strategy

REPO = Path(__file__).resolve().parents[2]
PLUGIN = REPO / "examples" / "plugins" / "median_sfl"
SHOWN = ("median_sfl.py", "pyproject.toml", "test_median_sfl.py")  # in the doc's order


def doc_blocks() -> list[str]:
    text = (REPO / "docs" / "algorithms.md").read_text()
    section = text[text.index("## Write your own algorithm") :]
    return re.findall(r"^```(?:python|toml)\n(.*?)^```$", section, flags=re.S | re.M)


def test_the_doc_shows_the_example_files_verbatim() -> None:
    assert doc_blocks() == [(PLUGIN / name).read_text() for name in SHOWN]


def test_the_shipped_contract_passes_on_the_example(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(PLUGIN))
    from median_sfl import MedianSFL

    check_strategy(MedianSFL)
    check_strategy(MedianSFL, {"min_updates": 5})  # the mean's path


@pytest.mark.slow
def test_the_examples_own_tests_pass_from_its_folder() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPLITMQ_")}
    env["PYTHONPATH"] = os.pathsep.join([str(PLUGIN), str(REPO)])
    pytest_here = ["-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(PLUGIN)]
    done = subprocess.run(
        [sys.executable, *pytest_here, "-c", str(PLUGIN / "pyproject.toml"), str(PLUGIN)],
        cwd=PLUGIN,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "7 passed" in done.stdout
