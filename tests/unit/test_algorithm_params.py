"""An algorithm's own parameters: from the job file, through the service's config, to the
client's plan and strategy."""

from __future__ import annotations

import pytest

from services.algorithms.registry import build_strategy
from services.client.plan import RoundPlan
from services.common.handout import client_config
from services.config.loading import load_settings
from tests.unit.test_client_peers import make_settings


def test_only_the_chosen_algorithms_section_is_its_params() -> None:
    settings = make_settings(
        "j", algorithm={"name": "splitgp", "splitgp": {"gamma": 0.3, "lam": 0.1}}
    )
    assert settings.algorithm.params() == {"gamma": 0.3, "lam": 0.1, "entropy_threshold": 0.5}
    assert make_settings("j").algorithm.params() == {}  # sfl_v2 has none


def test_the_services_params_reach_the_clients_plan_and_replace_its_own() -> None:
    service = make_settings("j", algorithm={"name": "splitgp", "splitgp": {"gamma": 0.9}})
    config = client_config(service, partition=0)
    assert config["params.gamma"] == 0.9

    own = RoundPlan.from_settings(make_settings("j"))  # a client whose file says sfl_v2
    plan = own.updated(config)
    assert plan.algorithm == "splitgp"
    assert plan.params["gamma"] == 0.9 and plan.params["lam"] == 0.2


def test_switching_algorithm_drops_the_old_params() -> None:
    own = RoundPlan.from_settings(
        make_settings("j", algorithm={"name": "splitgp", "splitgp": {"gamma": 0.9}})
    )
    plan = own.updated({"algorithm": "sfl_v2"})
    assert dict(plan.params) == {}


def test_the_environment_sets_an_algorithms_own_parameter() -> None:
    env = {"SPLITMQ_ALGORITHM__NAME": "splitgp", "SPLITMQ_ALGORITHM__SPLITGP__GAMMA": "0.3"}
    assert load_settings(None, env).algorithm.params()["gamma"] == 0.3
    # A variable naming no parameter section is someone else's, as any unknown SPLITMQ_*.
    assert load_settings(None, {"SPLITMQ_ALGORITHM__NOPE__X": "1"}).algorithm.params() == {}


def test_unknown_algorithm_is_refused_with_the_known_ones() -> None:
    with pytest.raises(ValueError, match="known: "):
        build_strategy("nope")
