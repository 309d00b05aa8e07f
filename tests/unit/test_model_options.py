"""`[model.options]`: keyword options from the job file reach the model's builder or factory, in
every role's build (`job_model`), and the run directory's config.toml keeps them."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from models.errors import ModelSpecError
from services.common.jobmodel import job_model
from services.config.root import Settings
from services.report.tomlwrite import dumps

RESNET = f"{Path(__file__).resolve().parents[2] / 'examples/models/small_resnet.py'}:small_resnet"


def settings(name: str, cut: str, **options: Any) -> Settings:
    return Settings.model_validate(
        {"model": {"name": name, "cut": cut, "options": options}, "algorithm": {"name": "sfl_v2"}}
    )


def test_options_reach_a_built_in_builder() -> None:
    with pytest.raises(ModelSpecError, match=r"its options are \['hidden', 'stages'\]"):
        job_model(settings("vgg_small", "fc1", width=24))
    assert job_model(settings("vgg_small", "fc1", hidden=24)).cut_shape("fc1") == (24,)
    net = job_model(settings("vgg_small", "stage2", stages=[[4], [6, 6]], hidden=8))
    assert net.cuts == ("stage1", "stage2", "fc1")
    assert net.cut_shape("stage2") == (6, 7, 7)  # fashion_mnist_sample: 1x28x28


def test_options_reach_a_factory() -> None:
    net = job_model(settings(RESNET, "layer1", width=6, blocks=2))
    assert net.cut_shape("layer1") == (6, 28, 28)
    assert "blocks.1.layer1.1.conv1.weight" in net.state_dict()


def test_an_unknown_option_lists_the_accepted_ones() -> None:
    with pytest.raises(
        ModelSpecError, match=r"'cnn5' has no options \['width'\]; its options are none"
    ):
        job_model(settings("cnn5", "block1", width=32))
    with pytest.raises(ModelSpecError, match=r"does not accept options.*'depth'"):
        job_model(settings(RESNET, "layer1", depth=3))


@pytest.mark.parametrize(
    ("options", "says"),
    [
        ({"width": {"a": 1}}, "model.options.width: .* is not a string, number, boolean"),
        ({"num_classes": 3}, "model.options.num_classes: set model.num_classes instead"),
        ({"input_size": 32}, "the dataset's image shape sets it"),
        ({"not-a-name": 1}, "an option name must be an identifier"),
    ],
)
def test_bad_options_are_refused_by_the_config(options: dict[str, Any], says: str) -> None:
    with pytest.raises(ValidationError, match=says):
        settings("cnn5", "block1", **options)


def test_the_run_directory_config_keeps_the_options() -> None:
    original = settings(RESNET, "layer1", width=6, stages=[[1, 2], [3]], flag=True)
    text = dumps(original.model_dump(mode="json"))
    reread = Settings.model_validate(tomllib.loads(text))
    assert reread.model.options == {"width": 6, "stages": [[1, 2], [3]], "flag": True}
