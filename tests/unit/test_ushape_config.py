"""`model.tail` (the U-shaped split): validated in the config and when the model is built, and
the split of the state it makes (the tail is client state, the server keeps what is between)."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from models.errors import ModelSpecError
from models.state import client_state, server_state
from services.common.jobmodel import job_model
from services.config.root import Settings


def settings(**model: Any) -> Settings:
    algorithm = model.pop("algorithm", "sfl_v2")
    rounds = model.pop("rounds", {})
    return Settings.model_validate(
        {
            "model": {"name": "cnn5", "cut": "block1", **model},
            "algorithm": {"name": algorithm},
            "rounds": rounds,
        }
    )


@pytest.mark.parametrize(
    ("model", "says"),
    [
        ({"tail": "classifier", "algorithm": "fedavg"}, "fedavg has no U-shaped split"),
        ({"tail": "classifier", "algorithm": "splitgp"}, "splitgp has no U-shaped split"),
        ({"tail": "classifier", "rounds": {"mode": "async"}}, "sync rounds only"),
        ({"tail": "block1"}, "is the cut's own block"),
        ({"tail": "block.1"}, "String should match pattern"),
    ],
)
def test_the_config_refuses_a_tail_it_cannot_run(model: dict[str, Any], says: str) -> None:
    with pytest.raises(ValidationError, match=says):
        settings(**model)


@pytest.mark.parametrize(
    ("tail", "says"),
    [
        ("block2", "leaves the server no block after the cut 'block1'"),
        ("fc9", "is not a block name"),
    ],
)
def test_building_the_model_refuses_a_tail_that_does_not_fit(tail: str, says: str) -> None:
    with pytest.raises(ModelSpecError, match=says):
        job_model(settings(tail=tail))


def test_the_tail_is_client_state_and_the_server_keeps_what_is_between() -> None:
    model = job_model(settings(tail="block3"))  # blocks: block1 | block2 | block3, classifier
    assert {n.split(".")[1] for n in client_state(model, "block1")} == {"0", "2", "3"}
    assert {n.split(".")[1] for n in server_state(model, "block1")} == {"1"}
    assert model.server_output_shape() == (20, 4, 4)  # block2 output
    assert len(model.server_blocks("block1")) == 1 and len(model.tail_blocks()) == 2
    plain = job_model(settings())
    assert plain.tail is None and len(plain.server_blocks("block1")) == 3
    with pytest.raises(ModelSpecError, match="not U-shaped"):
        plain.tail_blocks()
