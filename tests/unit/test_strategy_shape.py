"""The strategy stays narrow (issue 35): `StrategyBase` has at most 12 public members, the
server side is an object of its own, and `@algorithm` alone makes a registered class what a
strategy must be (a frozen keyword-only dataclass), refusing clearly what it cannot fix."""

from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass

import pytest

from services.algorithms.base import ServerSide, StrategyBase, Traits, algorithm
from services.algorithms.registry import specs_in
from services.algorithms.sfl import SFL

MOST = 12


def public_members(cls: type) -> set[str]:
    """Attributes and methods not starting with "_", less `object`'s; a dataclass field with a
    default factory (no class attribute) counts too."""
    names = {n for n, _ in inspect.getmembers(cls)} | {f.name for f in dataclasses.fields(cls)}
    return {n for n in names if not n.startswith("_")} - set(dir(object))


def test_strategy_base_has_at_most_twelve_public_members() -> None:
    narrow = public_members(StrategyBase)
    assert "defences" in narrow and len(narrow) <= MOST, sorted(narrow)
    # The docstring names them all.
    for name in narrow:
        assert f"`{name}`" in (StrategyBase.__doc__ or ""), name


def test_a_split_algorithm_has_a_server_side_and_a_plain_one_none() -> None:
    assert isinstance(SFL().server, ServerSide) and SFL().server.u_shaped
    assert StrategyBase().server is None
    assert isinstance(StrategyBase.traits, Traits)


def test_algorithm_alone_makes_a_frozen_keyword_only_dataclass() -> None:
    @algorithm("shape_test")
    class Keeper(SFL):
        keep: float = 0.25

    strategy = Keeper(name="x", keep=0.5)
    assert strategy.keep == 0.5 and Keeper().keep == 0.25
    with pytest.raises(dataclasses.FrozenInstanceError):
        strategy.keep = 1.0  # type: ignore[misc]
    with pytest.raises(TypeError):
        Keeper("x")  # type: ignore[misc]  # keyword-only
    assert [s.name for s in specs_in(Keeper)] == ["shape_test"]
    assert specs_in(SFL) and "shape_test" not in {s.name for s in specs_in(SFL)}


def test_an_explicit_dataclass_below_algorithm_is_kept() -> None:
    @algorithm("shape_test_explicit")
    @dataclass(frozen=True, kw_only=True)
    class Explicit(SFL):
        keep: float = 0.25

    assert Explicit(keep=1.0).keep == 1.0


def test_a_class_between_with_fields_and_no_dataclass_is_refused() -> None:
    class Forgot(SFL):
        keep: float = 0.25

    with pytest.raises(TypeError, match=r"Forgot declares fields \['keep'\] but is no dataclass"):

        @algorithm("shape_test_forgot")
        class Below(Forgot):
            pass


def test_algorithm_refuses_a_class_that_is_no_strategy() -> None:
    with pytest.raises(TypeError, match=r"registers StrategyBase subclasses, not .*Plain$"):

        @algorithm("shape_test_plain")  # type: ignore[type-var]
        class Plain:
            pass
