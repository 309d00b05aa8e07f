"""A user's own algorithm, in one file of a package of its own, trains through `splitmq run`.

The package (the example of docs/algorithms.md) is written here, outside the repository, and
installed with pip into a folder of its own; it declares its module in the `splitmq.algorithms`
entry-point group and touches no file of SplitMQ. A plugin that fails to import is named in
the error.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.integration.plugin_package import doc_example, pip_install, splitmq

pytestmark = pytest.mark.slow

# The plugin is the example of docs/algorithms.md "Write your own algorithm", as written there.
ALGORITHM = doc_example("algorithms.md", "## Write your own algorithm")

PYPROJECT = """
[build-system]
requires = ["setuptools"]
build-backend = "setuptools.build_meta"

[project]
name = "damped-plugin"
version = "0.1"

[tool.setuptools]
py-modules = ["damped_plugin"]

[project.entry-points."splitmq.algorithms"]
damped_fedavg = "damped_plugin"
broken_algo = "no_such_module_anywhere"
"""

CONFIG = """
[job]
name = "plugin"
rounds = 3

[data]
dataset = "fashion_mnist_sample"
eval_samples = 300

[algorithm]
name = "damped_fedavg"
batch_size = 32
lr = 0.05
max_steps_per_round = 5

[algorithm.damped_fedavg]
keep = 0.5

[clients]
count = 2
min_to_start = 2

[report]
dir = "{runs}"
"""


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The plugin package, pip-installed into a folder of its own (returned)."""
    return pip_install(tmp_path_factory.mktemp("plugin"), "damped_plugin", ALGORITHM, PYPROJECT)


def test_a_plugin_algorithm_trains_through_splitmq_run(installed: Path, tmp_path: Path) -> None:
    config = tmp_path / "plugin.toml"
    config.write_text(CONFIG.format(runs=tmp_path / "runs"))
    result = splitmq(installed, "run", str(config))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "| damped_fedavg | 2 clients |" in result.stdout
    (run_dir,) = (tmp_path / "runs").iterdir()
    doc = json.loads((run_dir / "metrics.json").read_text())
    assert doc["run"]["status"] == "finished"
    records = doc["records"]
    assert [r["version"] for r in records] == [2, 3, 4]
    assert all(r["participants"] == 2 and r["samples"] > 0 for r in records)
    # The plugin's own parameter reached its clients, and their metric the run's records.
    assert all(r["extra"]["damped_keep"] == 0.5 for r in records), records[-1]
    assert 'name = "damped_fedavg"' in (run_dir / "config.toml").read_text()


def test_a_plugin_that_fails_to_import_is_named(installed: Path, tmp_path: Path) -> None:
    config = tmp_path / "broken.toml"
    config.write_text('[algorithm]\nname = "broken_algo"\n')
    result = splitmq(installed, "run", str(config))
    assert result.returncode != 0
    assert "algorithm plugin 'broken_algo' (no_such_module_anywhere) failed to import" in (
        result.stdout + result.stderr
    )
