"""A user's own dataset, in a package of its own, trains through `splitmq run`.

The package (the example of docs/data.md, "Your own dataset") is written here, outside the
repository, and installed with pip into a folder of its own; it declares its loader in the
`splitmq.datasets` entry-point group and touches no file of SplitMQ. A plugin that fails to
import, or that names something which is not a dataset, is named in the error (checked in this
process, on the same installed folder).
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from services.data.errors import UnknownDatasetError
from services.data.loaders import find_source
from services.data.plugins import DatasetPluginError
from tests.integration.plugin_package import doc_example, pip_install, splitmq

pytestmark = pytest.mark.slow

# The plugin is the example of docs/data.md "Your own dataset", as written there.
PLUGIN = doc_example("data.md", "## Your own dataset")

PYPROJECT = """
[build-system]
requires = ["setuptools"]
build-backend = "setuptools.build_meta"

[project]
name = "stripes-plugin"
version = "0.1"

[tool.setuptools]
py-modules = ["stripes_plugin"]

[project.entry-points."splitmq.datasets"]
stripes = "stripes_plugin:stripes"
broken_data = "no_such_module_anywhere:load"
not_a_dataset = "math:pi"
"""

CONFIG = """
[job]
name = "stripes"
rounds = 2

[model]
num_classes = 2

[data]
dataset = "{dataset}"
eval_samples = 400

[algorithm]
name = "fedavg"
batch_size = 32
lr = 0.05
momentum = 0.9
max_steps_per_round = 8

[clients]
count = 2
min_to_start = 2

[report]
dir = "{runs}"
plots = false
"""


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The plugin package, pip-installed into a folder of its own (returned)."""
    return pip_install(tmp_path_factory.mktemp("plugin"), "stripes_plugin", PLUGIN, PYPROJECT)


def splitmq_run(target: Path, tmp_path: Path, dataset: str) -> subprocess.CompletedProcess[str]:
    config = tmp_path / f"{dataset}.toml"
    config.write_text(CONFIG.format(dataset=dataset, runs=tmp_path / "runs"))
    return splitmq(target, "run", str(config))


def test_a_plugin_dataset_trains_through_splitmq_run(installed: Path, tmp_path: Path) -> None:
    result = splitmq_run(installed, tmp_path, "stripes")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "| fedavg | 2 clients | stripes |" in result.stdout
    (run_dir,) = (tmp_path / "runs").iterdir()
    doc = json.loads((run_dir / "metrics.json").read_text())
    assert doc["run"]["status"] == "finished"
    records = doc["records"]
    assert [r["version"] for r in records] == [2, 3]
    # 2 clients x 8 steps x 32 samples a round
    assert all(r["participants"] == 2 and r["samples"] == 512 for r in records)
    assert records[-1]["global_accuracy"] > 0.7, f"2 classes: chance is 1/2, got {records[-1]}"


@pytest.mark.parametrize(
    ("dataset", "message"),
    [
        ("broken_data", "dataset plugin 'broken_data' (no_such_module_anywhere:load) failed"),
        ("not_a_dataset", "dataset plugin 'not_a_dataset' (math:pi) is a float: expected"),
    ],
)
def test_a_plugin_that_is_no_dataset_is_named(
    installed: Path, monkeypatch: pytest.MonkeyPatch, dataset: str, message: str
) -> None:
    # In this process: the installed folder on sys.path is what importlib.metadata searches.
    monkeypatch.syspath_prepend(str(installed))
    with pytest.raises(DatasetPluginError) as info:
        find_source(dataset)
    assert message in str(info.value)
    with pytest.raises(UnknownDatasetError, match=r"plugins: broken_data, not_a_dataset, stripes"):
        find_source("stripe")
