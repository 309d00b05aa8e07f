"""A user's own split algorithm, in one file of a package of its own, trains through
`splitmq run`.

The package (the worked example of docs/algorithms.md, examples/plugins/median_sfl/) is copied
outside the repository and installed with pip into a folder of its own; it declares its module
in the `splitmq.algorithms` entry-point group and touches no file of SplitMQ. A plugin that
fails to import is named in the error.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.integration.plugin_package import REPO, pip_install, splitmq

pytestmark = pytest.mark.slow

# The example docs/algorithms.md "Write your own algorithm" shows (tests/unit/
# test_algorithm_plugin_example.py: verbatim), with a broken entry point besides.
ALGORITHM = (REPO / "examples" / "plugins" / "median_sfl" / "median_sfl.py").read_text()

PYPROJECT = """
[build-system]
requires = ["setuptools"]
build-backend = "setuptools.build_meta"

[project]
name = "median-sfl"
version = "0.1"

[tool.setuptools]
py-modules = ["median_sfl"]

[project.entry-points."splitmq.algorithms"]
median_sfl = "median_sfl"
broken_algo = "no_such_module_anywhere"
"""

CONFIG = """
[job]
name = "plugin"
rounds = 3

[data]
dataset = "fashion_mnist_sample"
eval_samples = 300

[model]
name = "cnn5"
cut = "block1"

[algorithm]
name = "median_sfl"
batch_size = 32
lr = 0.05
max_steps_per_round = 5

[algorithm.median_sfl]
min_updates = 3

[clients]
count = 3
min_to_start = 3

[report]
dir = "{runs}"
"""


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The plugin package, pip-installed into a folder of its own (returned)."""
    return pip_install(tmp_path_factory.mktemp("plugin"), "median_sfl", ALGORITHM, PYPROJECT)


def test_a_plugin_algorithm_trains_through_splitmq_run(installed: Path, tmp_path: Path) -> None:
    config = tmp_path / "plugin.toml"
    config.write_text(CONFIG.format(runs=tmp_path / "runs"))
    result = splitmq(installed, "run", str(config))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "| median_sfl | 3 clients |" in result.stdout
    (run_dir,) = (tmp_path / "runs").iterdir()
    doc = json.loads((run_dir / "metrics.json").read_text())
    assert doc["run"]["status"] == "finished"
    assert doc["run"]["cut"] == "block1"  # a split algorithm: the banner names its cut
    records = doc["records"]
    assert [r["version"] for r in records] == [2, 3, 4]
    assert all(r["participants"] == 3 and r["samples"] > 0 for r in records)
    written = (run_dir / "config.toml").read_text()
    assert 'name = "median_sfl"' in written and "min_updates = 3" in written


def test_a_plugin_that_fails_to_import_is_named(installed: Path, tmp_path: Path) -> None:
    config = tmp_path / "broken.toml"
    config.write_text('[algorithm]\nname = "broken_algo"\n')
    result = splitmq(installed, "run", str(config))
    assert result.returncode != 0
    assert "algorithm plugin 'broken_algo' (no_such_module_anywhere) failed to import" in (
        result.stdout + result.stderr
    )
