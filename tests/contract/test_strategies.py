"""The strategy contract (`services.testing`, shipped with the package) on every registered
algorithm, built-in or an installed plugin's, with its default parameters; and what the config
and the registry make of the registrations.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
from pydantic import ValidationError

from services.algorithms.base import AlgorithmSpec
from services.algorithms.registry import BUILTINS, REGISTRY, AlgorithmPluginError, Registry
from services.config.root import Settings
from services.testing.strategy_contract import CHECKS, Case

SPECS = [REGISTRY.get(name) for name in REGISTRY.names()]  # each module imported


@pytest.mark.parametrize("check", CHECKS, ids=[c.__name__ for c in CHECKS])
@pytest.mark.parametrize("spec", SPECS, ids=[s.name for s in SPECS])
def test_the_contract(spec: AlgorithmSpec, check: Callable[[Case], None]) -> None:
    check(Case(spec))


def test_every_builtin_name_is_registered_by_its_module() -> None:
    assert {s.name for s in SPECS} >= set(BUILTINS)


@pytest.mark.parametrize("spec", SPECS, ids=[s.name for s in SPECS])
def test_the_config_refuses_async_for_a_sync_only_algorithm(spec: AlgorithmSpec) -> None:
    config = {"algorithm": {"name": spec.name}, "rounds": {"mode": "async"}}
    if spec.sync_only:
        with pytest.raises(ValidationError, match=f"{spec.name} stays synchronous"):
            Settings.model_validate(config)
    else:
        assert Settings.model_validate(config).asynchronous_mode


def test_a_fresh_registry_finds_only_what_it_is_given() -> None:
    registry = Registry(builtins={"sfl_v2": "sfl"}, group="splitmq.no-such-group")
    assert registry.names() == ["sfl_v2"]
    assert registry.build("sfl_v2").name == "sfl_v2"
    # The module registers all it defines: the other SFL variants come with it.
    with pytest.raises(ValueError, match=r"unknown algorithm 'fedavg'; known: \['sfl', 'sfl_v1'"):
        registry.get("fedavg")
    wrong = Registry(builtins={"fedavg": "sfl"}, group="splitmq.no-such-group")
    with pytest.raises(ValueError, match="registers no algorithm"):
        wrong.get("fedavg")
    missing = Registry(builtins={"x": "no_such_module"}, group="splitmq.no-such-group")
    for _ in range(2):  # told each time, not only the first
        with pytest.raises(AlgorithmPluginError, match="no_such_module failed to import"):
            missing.get("x")
