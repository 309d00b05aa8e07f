"""Async mode's pure math: the staleness functions and the fold of stale updates (no broker)."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch.testing import assert_close

from broker.store import AUX_PART, CLIENT_PART, SERVER_PART, BlobRef
from services.algorithms.async_fold import (
    StaleUpdate,
    fold,
    rebase_state,
    rebased_replica,
    rebased_update,
)
from services.algorithms.base import ClientUpdate, ShardReplica
from services.algorithms.registry import REGISTRY, build_strategy
from services.algorithms.staleness import StalenessRule

CLIENT = BlobRef(CLIENT_PART)
SERVER = BlobRef(SERVER_PART)
AUX = BlobRef(AUX_PART)


# --- staleness functions ------------------------------------------------------------------------


def polynomial(tau: int, a: float = 0.5) -> float:
    return StalenessRule("polynomial", a=a).weight(tau)


def hinge(tau: int, a: float, b: int) -> float:
    return StalenessRule("hinge", a=a, b=b).weight(tau)


def test_polynomial_is_one_over_root_of_one_plus_tau_by_default() -> None:
    assert polynomial(0) == 1.0
    assert polynomial(3) == pytest.approx(0.5)  # (1 + 3) ** -0.5
    assert polynomial(8) == pytest.approx(1 / 3)
    assert polynomial(1, a=2.0) == pytest.approx(0.25)
    assert polynomial(5, a=0.0) == 1.0


def test_hinge_is_flat_up_to_b_then_falls_hyperbolically() -> None:
    assert [hinge(t, a=0.5, b=2) for t in range(3)] == [1.0, 1.0, 1.0]
    assert hinge(3, a=0.5, b=2) == pytest.approx(1 / 1.5)
    assert hinge(6, a=0.5, b=2) == pytest.approx(1 / 3.0)
    assert hinge(10, a=0.0, b=2) == 1.0


def test_constant_ignores_staleness() -> None:
    assert [StalenessRule("constant").weight(t) for t in (0, 1, 50)] == [1.0, 1.0, 1.0]


@pytest.mark.parametrize("kind", ["constant", "polynomial", "hinge"])
def test_every_function_counts_fresh_updates_fully_and_never_rises(kind: str) -> None:
    rule = StalenessRule(kind, a=0.7, b=2, max_staleness=20)  # type: ignore[arg-type]
    weights = [rule.weight(t) for t in range(21)]
    assert weights[0] == 1.0
    assert all(0.0 < w <= 1.0 for w in weights)
    assert all(b <= a for a, b in itertools.pairwise(weights))


def test_negative_staleness_and_bad_parameters_are_refused() -> None:
    with pytest.raises(ValueError, match="staleness must be >= 0"):
        polynomial(-1)
    with pytest.raises(ValueError, match="a >= 0"):
        StalenessRule("polynomial", a=-1.0)
    with pytest.raises(ValueError, match="unknown staleness"):
        StalenessRule("linear")  # type: ignore[arg-type]
    rule = StalenessRule(max_staleness=2)
    assert [rule.accepts(t) for t in (-1, 0, 2, 3)] == [False, True, True, False]


# --- rebasing -----------------------------------------------------------------------------------


def test_rebase_replays_the_scaled_change_on_the_current_weights() -> None:
    base = {"w": torch.tensor([1.0, 2.0]), "b": torch.tensor([0.5])}
    update = {"w": torch.tensor([3.0, 0.0]), "b": torch.tensor([1.5])}
    current = {"w": torch.tensor([10.0, 10.0]), "b": torch.tensor([0.0])}
    out = rebase_state(update, base, current, 0.5)
    assert_close(out["w"], torch.tensor([11.0, 9.0]))
    assert_close(out["b"], torch.tensor([0.5]))


def test_rebase_keeps_statistics_counters_and_unknown_tensors_as_uploaded() -> None:
    base = {
        "bn.running_var": torch.tensor([1.0]),
        "bn.num_batches_tracked": torch.tensor(5),
        "w": torch.tensor([0.0]),
    }
    current = {
        "bn.running_var": torch.tensor([0.2]),
        "bn.num_batches_tracked": torch.tensor(9),
        "w": torch.tensor([1.0]),
    }
    update = {
        "bn.running_var": torch.tensor([0.3]),  # replayed: 0.2 + (0.3 - 1.0) < 0, a bad variance
        "bn.num_batches_tracked": torch.tensor(7),
        "w": torch.tensor([2.0]),
        "extra": torch.tensor([4.0]),
    }
    out = rebase_state(update, base, current, 1.0)
    assert_close(out["bn.running_var"], torch.tensor([0.3]))
    assert int(out["bn.num_batches_tracked"]) == 7
    assert_close(out["w"], torch.tensor([3.0]))
    assert_close(out["extra"], torch.tensor([4.0]))


def test_rebase_keeps_the_update_dtype() -> None:
    out = rebase_state(
        {"w": torch.tensor([1.0], dtype=torch.float16)},
        {"w": torch.tensor([0.0])},
        {"w": torch.tensor([2.0])},
        1.0,
    )
    assert out["w"].dtype == torch.float16 and float(out["w"]) == 3.0


# --- the fold -----------------------------------------------------------------------------------


def state(value: float) -> dict[str, torch.Tensor]:
    return {"blocks.0.weight": torch.full((2, 2), value), "blocks.0.bias": torch.full((2,), value)}


def stale(
    client: str, value: float, samples: int, tau: int, base: float, now: float
) -> StaleUpdate:
    return StaleUpdate(
        update=ClientUpdate(client, samples, 1, state(value)),
        tau=tau,
        base_client=state(base),
        base_aux={},
        current_client=state(now),
        current_aux={},
    )


def test_fresh_updates_fold_exactly_like_the_synchronous_average() -> None:
    strategy = build_strategy("fedavg")
    current = {CLIENT: state(1.0)}
    updates = [stale("a", 3.0, 100, 0, 1.0, 1.0), stale("b", 6.0, 200, 0, 1.0, 1.0)]
    folded = fold(strategy, current, updates, StalenessRule())
    synced = strategy.aggregate(current, [u.update for u in updates], [])
    for name, tensor in synced[CLIENT].items():
        assert torch.equal(folded[CLIENT][name], tensor)
        assert_close(tensor, torch.full_like(tensor, 5.0))  # (100*3 + 200*6) / 300


def test_a_stale_update_moves_the_model_by_its_discounted_change() -> None:
    """FedBuff: x_new = x_now + sum_k alpha_k s(tau_k) (w_k - w_base_k)."""
    strategy = build_strategy("sfl_v2")
    current = {CLIENT: state(10.0), SERVER: state(7.0), AUX: state(0.0)}
    # a: fresh, +2 on the current model; b: 3 versions old, +4 on a model that was at 2.
    updates = [stale("a", 12.0, 100, 0, 10.0, 10.0), stale("b", 6.0, 300, 3, 2.0, 10.0)]
    folded = fold(strategy, current, updates, StalenessRule("polynomial", a=0.5, max_staleness=3))
    expected = 10.0 + 0.25 * 2.0 + 0.75 * 0.5 * 4.0
    for tensor in folded[CLIENT].values():
        assert_close(tensor, torch.full_like(tensor, expected))
    assert folded[SERVER] is current[SERVER]  # no replica: the server side stands
    assert folded[AUX] is current[AUX]


def test_fresh_replicas_go_through_the_strategy_weighted_by_their_samples() -> None:
    strategy = build_strategy("sfl")
    server_now = state(1.0)
    # Shard 0 went from 1 to 3 since its last fold, shard 1 from 5 to 4 (another frame).
    replicas = [
        rebased_replica(0, state(3.0), state(1.0), server_now, 100),
        rebased_replica(1, state(4.0), state(5.0), server_now, 300),
    ]
    assert_close(replicas[1].weights["blocks.0.bias"], torch.full((2,), 0.0))
    current = {CLIENT: state(0.0), SERVER: server_now}
    folded = fold(strategy, current, [stale("a", 1.0, 10, 0, 0.0, 0.0)], StalenessRule(), replicas)
    expected = 1.0 + 0.25 * 2.0 + 0.75 * -1.0
    for tensor in folded[SERVER].values():
        assert_close(tensor, torch.full_like(tensor, expected))


def test_one_shard_folds_to_its_own_checkpoint() -> None:
    checkpoint = state(3.25)
    replica = rebased_replica(0, checkpoint, state(1.5), state(1.5), 64)
    assert isinstance(replica, ShardReplica)
    for name, tensor in replica.weights.items():
        assert torch.equal(tensor, checkpoint[name])


def test_a_fold_refuses_updates_beyond_the_bound() -> None:
    with pytest.raises(ValueError, match="beyond max_staleness"):
        fold(
            build_strategy("fedavg"),
            {CLIENT: state(0.0)},
            [stale("a", 1.0, 1, 5, 0.0, 0.0)],
            StalenessRule(max_staleness=4),
        )
    with pytest.raises(ValueError, match="nothing buffered"):
        fold(build_strategy("fedavg"), {CLIENT: state(0.0)}, [], StalenessRule())


def test_partial_uploads_rebase_only_the_tensors_they_hold() -> None:
    update = StaleUpdate(
        update=ClientUpdate("a", 1, 1, {"blocks.0.bias": torch.full((2,), 4.0)}),
        tau=1,
        base_client=state(2.0),
        base_aux={},
        current_client=state(3.0),
        current_aux={},
    )
    out = rebased_update(update, StalenessRule("constant"))
    assert set(out.client_weights) == {"blocks.0.bias"}
    assert_close(out.client_weights["blocks.0.bias"], torch.full((2,), 5.0))


def test_only_the_per_step_barrier_keeps_an_algorithm_synchronous() -> None:
    refusals = {name: build_strategy(name).async_refusal() for name in REGISTRY.names()}
    assert {name for name, why in refusals.items() if why is not None} == {"minibatch_sfl"}
    assert "barrier" in str(refusals["minibatch_sfl"])
