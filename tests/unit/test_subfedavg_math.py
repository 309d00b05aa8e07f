"""Sub-FedAvg's pure math on hand-computed cases: mask derivation, the adoption rule,
intersection averaging, hybrid channel masks and the FLOP counter."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from models.registry import build_model
from models.split import SplitNet
from services.algorithms.pruning import (
    AdoptionRule,
    apply_masks,
    build_layout,
    channel_mask,
    count_flops,
    flat_hamming,
    gradient_masker,
    hamming_distance,
    masked_state,
    param_reduction,
    percentile_mask,
    step_percent,
)
from services.algorithms.subfedavg import intersection_average

T = torch.tensor


def bools(*values: int) -> torch.Tensor:
    return T(values, dtype=torch.bool)


# --- intersection averaging --------------------------------------------------------------
def test_intersection_average_by_hand_zero_count_keeps_the_old_value() -> None:
    previous = {"w": T([10.0, 20.0, 30.0]), "b": T([0.0]), "n": T(4)}
    a = {"w": T([1.0, 2.0, 0.0]), "b": T([1.0]), "n": T(7)}
    b = {"w": T([3.0, 0.0, 0.0]), "b": T([3.0]), "n": T(5)}
    masks = [{"w": bools(1, 1, 0)}, {"w": bools(1, 0, 0)}]
    out = intersection_average(previous, [a, b], masks)
    # element 0: both keep it -> (1+3)/2; element 1: only a -> 2; element 2: nobody -> old 30.
    assert torch.equal(out["w"], T([2.0, 2.0, 30.0]))
    assert torch.equal(out["b"], T([2.0]))  # unmasked: plain mean
    assert int(out["n"]) == 7  # integer counters: the maximum


def test_intersection_average_with_sample_weights() -> None:
    previous = {"w": T([0.0, 0.0])}
    a, b = {"w": T([1.0, 4.0])}, {"w": T([3.0, 8.0])}
    out = intersection_average(previous, [a, b], [{"w": bools(1, 1)}, {"w": bools(1, 0)}], [1, 3])
    # element 0: (1*1 + 3*3) / 4 = 2.5; element 1: only a keeps it -> 4.
    assert torch.equal(out["w"], T([2.5, 4.0]))


def test_intersection_average_ignores_what_a_mask_prunes_and_treats_no_mask_as_all_kept() -> None:
    previous = {"w": T([9.0, 9.0])}
    # Client a did not zero its pruned entry: the mask, not the value, decides.
    a, b = {"w": T([1.0, 100.0])}, {"w": T([3.0, 5.0])}
    out = intersection_average(previous, [a, b], [{"w": bools(1, 0)}, {}])
    assert torch.equal(out["w"], T([2.0, 5.0]))


def test_intersection_average_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="no client states"):
        intersection_average({}, [], [])
    with pytest.raises(ValueError, match="mask shape"):
        intersection_average({"w": T([1.0])}, [{"w": T([1.0])}], [{"w": bools(1, 0)}])
    with pytest.raises(ValueError, match="absent from the previous"):
        intersection_average({}, [{"w": T([1.0])}], [{"w": bools(1)}])


# --- mask derivation ---------------------------------------------------------------------
def test_percentile_mask_prunes_the_lowest_percent_of_the_alive_weights() -> None:
    w = T([0.1, -0.2, 0.3, -0.4, 0.5])
    # 20% quantile of [.1 .2 .3 .4 .5] (linear interpolation): .1 + .8*.1 = .18 -> only .1 goes.
    assert torch.equal(percentile_mask(w, bools(1, 1, 1, 1, 1), 0.2), bools(0, 1, 1, 1, 1))
    # Alive [.1 .3 .4 .5] (the .2 is already pruned): 50% quantile .35 -> .1 and .3 go; the
    # pruned one stays pruned whatever its magnitude.
    assert torch.equal(percentile_mask(w, bools(1, 0, 1, 1, 1), 0.5), bools(0, 0, 0, 1, 1))


def test_percentile_mask_is_per_layer() -> None:
    model = nn.Sequential(nn.Linear(2, 2, bias=False), nn.Linear(2, 2, bias=False))
    with torch.no_grad():
        model[0].weight.copy_(T([[1.0, 2.0], [3.0, 4.0]]))
        model[1].weight.copy_(T([[100.0, 200.0], [300.0, 400.0]]))
    ones = torch.ones(2, 2, dtype=torch.bool)
    # Each layer loses its own smallest quarter (a global threshold would prune all of layer 0).
    for name in ("0.weight", "1.weight"):
        got = percentile_mask(model.get_parameter(name), ones, 0.25)
        assert torch.equal(got, T([[False, True], [True, True]])), name


def test_percentile_mask_keeps_ties_and_empty_layers() -> None:
    assert torch.equal(percentile_mask(T([0.5, 0.5]), bools(1, 1), 0.5), bools(1, 1))
    assert torch.equal(percentile_mask(T([0.5, 0.5]), bools(0, 0), 0.5), bools(0, 0))


def test_hamming_distance_is_the_mean_over_layers() -> None:
    a = {"x": bools(1, 1, 1, 1), "y": bools(1, 0)}
    b = {"x": bools(1, 1, 1, 0), "y": bools(1, 0)}
    assert hamming_distance(a, b) == pytest.approx((1 / 4 + 0) / 2)
    # The channel distance is over all channels together: 1 of 6.
    assert flat_hamming(list(a.values()), list(b.values())) == pytest.approx(1 / 6)
    with pytest.raises(ValueError, match="different tensors"):
        hamming_distance(a, {"x": a["x"]})


def test_step_percent_stops_at_the_target() -> None:
    assert step_percent(0.2, 0.0, 0.5) == 0.2
    # 40% pruned, target 50%: prune (0.5-0.4)/(1-0.4) of the 60% alive -> exactly 50%.
    assert step_percent(0.2, 0.4, 0.5) == pytest.approx(1 / 6)
    assert step_percent(0.2, 0.5, 0.5) == 0.0


@pytest.mark.parametrize(
    ("distance", "sparsity", "accuracy", "adopted"),
    [
        (0.01, 0.1, 0.9, True),  # every condition holds
        (0.0001, 0.1, 0.9, False),  # masks did not move more than dist_thresh (not >)
        (0.01, 0.5, 0.9, False),  # target reached
        (0.01, 0.1, 0.5, False),  # accuracy not above acc_thresh
    ],
)
def test_adoption_rule_each_condition(
    distance: float, sparsity: float, accuracy: float, adopted: bool
) -> None:
    rule = AdoptionRule(dist_thresh=0.0001, target=0.5, acc_thresh=0.5)
    assert (rule.should_try(distance, sparsity) and rule.accepts(accuracy)) is adopted


# --- masking -----------------------------------------------------------------------------
def test_masked_gradients_keep_pruned_weights_exactly_zero_under_momentum() -> None:
    torch.manual_seed(0)
    layer = nn.Linear(4, 3)
    masks = {"weight": torch.rand(3, 4) > 0.5}
    apply_masks(layer, masks)
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.5, momentum=0.9)
    mask_gradients = gradient_masker(layer, masks)
    for _ in range(5):
        optimizer.zero_grad()
        layer(torch.randn(8, 4)).pow(2).sum().backward()
        mask_gradients()
        optimizer.step()
    assert torch.count_nonzero(layer.weight[~masks["weight"]]) == 0
    assert torch.count_nonzero(layer.weight[masks["weight"]]) == int(masks["weight"].sum())


def test_masked_state_and_param_reduction() -> None:
    state = {"w": T([1.0, 2.0, 3.0, 4.0]), "b": T([5.0, 6.0])}
    masks = {"w": bools(1, 0, 0, 1)}
    assert torch.equal(masked_state(state, masks)["w"], T([1.0, 0.0, 0.0, 4.0]))
    assert torch.equal(masked_state(state, masks)["b"], state["b"])
    assert param_reduction(state, masks) == pytest.approx(2 / 6)


# --- hybrid: channels by BN scale ---------------------------------------------------------
def test_channel_mask_prunes_by_bn_scale_above_a_floor() -> None:
    gamma = T([0.9, -0.1, 0.5, 0.2, 1.0, 0.3, 0.8, 0.6, 0.7, 0.4])
    alive = torch.ones(10, dtype=torch.bool)
    # floor(10 * 0.3) = 3: the threshold is the 4th smallest |gamma|, .4; .1 .2 .3 .4 go.
    got = channel_mask(gamma, alive, 0.3, floor=5)
    assert torch.equal(got, bools(1, 0, 1, 0, 1, 0, 1, 1, 1, 0))
    # Among the 6 still alive, floor(6 * 0.3) = 1: .5 and .6 go next.
    assert torch.equal(channel_mask(gamma, got, 0.3, floor=2), bools(1, 0, 0, 0, 1, 0, 1, 0, 1, 0))
    # 50% would keep 4 < floor 5: the layer is left as it is.
    assert torch.equal(channel_mask(gamma, alive, 0.5, floor=5), alive)


def hybrid_cnn5() -> SplitNet:
    torch.manual_seed(0)
    return build_model("cnn5")


def test_hybrid_layout_turns_channel_masks_into_element_masks() -> None:
    model = hybrid_cnn5()
    layout = build_layout(model, "hybrid", range(len(model.blocks)))
    shapes = {n: t.shape for n, t in model.state_dict().items()}
    channels = {u.bn: torch.ones(u.channels, dtype=torch.bool) for u in layout.units}
    channels["blocks.0.bn"][[1, 3]] = False  # block1: 10 channels
    channels["blocks.1.bn"][0] = False  # block2: 20 channels, 4x4 each after the pool
    weights = {n: torch.ones(shapes[n], dtype=torch.bool) for n in layout.weights}
    masks = layout.element_masks(weights, channels)

    conv0, conv1 = masks["blocks.0.conv.weight"], masks["blocks.1.conv.weight"]
    assert not conv0[1].any() and not conv0[3].any() and conv0[0].all()
    assert torch.equal(masks["blocks.0.conv.bias"], channels["blocks.0.bn"])
    for entry in ("weight", "bias", "running_mean", "running_var"):
        assert torch.equal(masks[f"blocks.0.bn.{entry}"], channels["blocks.0.bn"])
    # conv of block2: its pruned filter 0, and the input slices of block1's pruned channels.
    assert not conv1[0].any()
    assert not conv1[:, 1].any() and not conv1[:, 3].any() and conv1[1:, 0].all()
    # first FC after the flatten: block2's channel 0 feeds columns 0..15.
    fc = masks["blocks.2.fc.weight"]
    assert not fc[:, :16].any() and fc[:, 16:].all()
    assert masks["blocks.3.fc.weight"].all()

    # Applied to the model, the pruned channel's output is exactly zero.
    apply_masks(model, masks)
    model.eval()
    with torch.no_grad():
        out = model.blocks[0](torch.randn(2, 1, 28, 28))
    assert torch.count_nonzero(out[:, [1, 3]]) == 0 and torch.count_nonzero(out[:, 0]) > 0


def test_hybrid_refuses_models_whose_channels_do_not_chain() -> None:
    model = build_model("resnet18")
    with pytest.raises(ValueError, match="plain conv-BN chain"):
        build_layout(model, "hybrid", range(len(model.blocks)))


def test_client_scope_covers_only_the_client_blocks() -> None:
    model = hybrid_cnn5()
    layout = build_layout(model, "unstructured", range(model.cut_index("block1") + 1))
    assert layout.weights == ("blocks.0.conv.weight",)
    assert set(layout.params(model)) == {
        "blocks.0.conv.weight",
        "blocks.0.conv.bias",
        "blocks.0.bn.weight",
        "blocks.0.bn.bias",
    }


# --- FLOPs -------------------------------------------------------------------------------
def tiny() -> SplitNet:
    return SplitNet(
        [("conv", nn.Conv2d(1, 2, 3)), ("fc", nn.Sequential(nn.Flatten(), nn.Linear(8, 2)))],
        input_shape=(1, 4, 4),
        num_classes=2,
    )


def test_flop_counter_by_hand() -> None:
    model = tiny()
    prefixes = ("blocks.0.", "blocks.1.")
    # conv: 18 weights x 2x2 output positions; fc: 16 weights once; 2 FLOPs per MAC.
    dense = count_flops(model, prefixes, {})
    assert (dense.sparse, dense.dense) == (2 * (18 * 4 + 16), 176)
    masks = {
        "blocks.0.weight": torch.arange(18).view(2, 1, 3, 3) % 2 == 0,  # 9 of 18 kept
        "blocks.1.1.weight": torch.arange(16).view(2, 8) < 4,  # 4 of 16 kept
    }
    got = count_flops(model, prefixes, masks)
    assert got.sparse == 2 * (9 * 4 + 4)
    assert got.reduction == pytest.approx(1 - 80 / 176)
    # Only the blocks in scope count.
    assert count_flops(model, ("blocks.0.",), {}).dense == 2 * 18 * 4
