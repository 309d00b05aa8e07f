"""FedSplitX and local-loss SFL: the math against hand-computed cases, then the strategy's
client round, server step and aggregation on a real cnn5."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from broker.store import AUX_PART, CLIENT_PART, SERVER_PART, BlobRef
from models.flops import forward_flops
from models.parts import ServerModel
from models.registry import build_model
from models.split import SplitNet
from models.state import client_state, head_state
from services.algorithms.base import (
    ClientContext,
    ClientUpdate,
    CohortBatch,
    Hyper,
    LocalRound,
    ShardReplica,
    VersionWeights,
    assign_level,
)
from services.algorithms.fedsplitx import (
    FedSplitX,
    heteroavg,
    level_costs,
    local_loss,
    parse_cuts,
    replica_holdings,
    server_loss,
    tensor_depth,
)
from services.algorithms.registry import build_strategy
from services.config.job import ClientsSection

CUTS = ("block1", "block2", "block3")


def t(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


# --- heteroavg ------------------------------------------------------------------------------------


def test_heteroavg_averages_each_tensor_over_its_own_holders() -> None:
    previous = {"a": t(0.0), "b": t(0.0), "c": t(0.0), "d": t(5.0)}
    holdings = [
        ({"a": t(1.0), "b": t(2.0)}, 1.0),  # a shallow client
        ({"a": t(3.0)}, 3.0),  # a client holding less
        ({"b": t(10.0), "c": t(4.0)}, 2.0),  # a replica: c is held by it alone
        ({"a": t(100.0)}, 0.0),  # trained nothing: not a holder
    ]
    out = heteroavg(holdings, previous)
    assert out["a"].item() == pytest.approx((1 * 1 + 3 * 3) / 4)  # 2.5
    assert out["b"].item() == pytest.approx((2 * 1 + 10 * 2) / 3)  # 22/3
    assert out["c"].item() == 4.0  # one holder: its value, whatever its weight
    assert out["d"].item() == 5.0  # no holder: the previous value


def test_heteroavg_keeps_everything_without_holders_and_refuses_foreign_names() -> None:
    previous = {"a": t(1.0, 2.0)}
    assert torch.equal(heteroavg([], previous)["a"], previous["a"])
    with pytest.raises(ValueError, match="does not have"):
        heteroavg([({"zz": t(1.0)}, 1.0)], previous)


def test_tensor_depth_reads_blocks_and_heads() -> None:
    index = {"block1": 0, "block2": 1}
    assert tensor_depth("blocks.3.fc.weight", index) == 3
    assert tensor_depth("heads.block2.fc.bias", index) == 1
    assert tensor_depth("heads.nope.fc.bias", index) is None
    assert tensor_depth("other", index) is None


def test_a_replica_holds_each_tensor_with_the_rows_that_reached_it() -> None:
    index = {"block1": 0, "block2": 1, "block3": 2}
    weights = {
        "blocks.1.w": t(1.0),  # after block1 only
        "blocks.2.w": t(2.0),  # after block1 and block2
        "blocks.3.w": t(3.0),  # after every cut
        "heads.block2.fc.w": t(4.0),  # a_2: the server trains it for level-1 batches
        "heads.block3.fc.w": t(5.0),  # a_3: for level-1 and level-2 batches
    }
    held = replica_holdings(weights, {"block1": 10, "block2": 5}, index, CUTS)
    by_name = {name: w for state, w in held for name in state}
    assert by_name == {
        "blocks.1.w": 10.0,
        "blocks.2.w": 15.0,
        "blocks.3.w": 15.0,
        "heads.block2.fc.w": 10.0,
        "heads.block3.fc.w": 15.0,
    }
    # Only level-2 batches: block 1 and head a_2 were not trained, so not held.
    held = replica_holdings(weights, {"block2": 5}, index, CUTS)
    assert {n for state, _ in held for n in state} == {
        "blocks.2.w",
        "blocks.3.w",
        "heads.block3.fc.w",
    }
    # A head that is no partition point is never trained by the server.
    held = replica_holdings(weights, {"block1": 10}, index, ("block1", "block3"))
    assert "heads.block2.fc.w" not in {n for state, _ in held for n in state}
    with pytest.raises(ValueError, match="unknown cuts"):
        replica_holdings(weights, {"blockX": 1}, index, CUTS)


# --- losses and levels ----------------------------------------------------------------------------


def test_local_loss_is_the_sum_of_the_heads_cross_entropies() -> None:
    y = torch.tensor([1])
    # Softmax of (0, ln 3) is (1/4, 3/4): cross-entropy ln(4/3). Of (0, 0): ln 2.
    three_quarters = torch.tensor([[0.0, math.log(3.0)]])
    even = torch.zeros(1, 2)
    assert local_loss([three_quarters], y).item() == pytest.approx(math.log(4 / 3))
    assert local_loss([three_quarters, even], y).item() == pytest.approx(
        math.log(4 / 3) + math.log(2)
    )
    with pytest.raises(ValueError):
        local_loss([], y)


def test_server_loss_adds_the_output_to_the_deeper_heads() -> None:
    y = torch.tensor([0])
    even = torch.zeros(1, 2)
    sure = torch.tensor([[math.log(3.0), 0.0]])  # p(y) = 3/4
    assert server_loss([], even, y).item() == pytest.approx(math.log(2))  # level M: output only
    assert server_loss([even, even], sure, y).item() == pytest.approx(
        2 * math.log(2) + math.log(4 / 3)
    )


@pytest.mark.parametrize(
    ("capability", "levels", "default", "level"),
    [
        (0, 3, 1, 1),  # none declared: the default
        (2, 3, 1, 2),
        (3, 3, 1, 3),
        (7, 3, 1, 3),  # more than there is: the deepest
        (0, 3, 2, 2),
        (0, 3, 9, 3),  # the default is capped too
        (2, 1, 1, 1),  # one level (local-loss SFL)
    ],
)
def test_assign_level_caps_the_declared_capability(
    capability: int, levels: int, default: int, level: int
) -> None:
    assert assign_level(capability, levels, default) == level


def test_the_capability_mix_deals_levels_by_partition() -> None:
    clients = ClientsSection(count=50, capability_mix="16,16,18")
    levels = [clients.declared_capability(p) for p in range(50)]
    assert levels.count(1) == 16 and levels.count(2) == 16 and levels.count(3) == 18
    assert levels[15] == 1 and levels[16] == 2 and levels[32] == 3
    assert clients.declared_capability(None) == 0
    own = ClientsSection(count=50, capability_mix="16,16,18", capability=2)
    assert own.declared_capability(0) == 2  # a declared capability wins over the mix
    with pytest.raises(ValueError, match="covers 3 clients"):
        ClientsSection(count=4, capability_mix="1,1,1")


def test_parse_cuts() -> None:
    assert parse_cuts(" block1 , block3") == ("block1", "block3")
    assert parse_cuts("") == ()
    with pytest.raises(ValueError):
        parse_cuts("block1,block1")


# --- FLOPs ----------------------------------------------------------------------------------------


def test_forward_flops_counts_conv_and_linear_multiply_adds_twice() -> None:
    # Conv 1->2, 3x3 on 5x5: 2*3*3 outputs of 9 MACs = 162; Linear 18->4: 72 MACs.
    module = nn.Sequential(nn.Conv2d(1, 2, 3), nn.ReLU(), nn.Flatten(), nn.Linear(18, 4))
    assert forward_flops(module, (1, 5, 5)) == 2 * (162 + 72)
    assert module.training  # flags restored


def test_level_costs_of_cnn5_by_hand() -> None:
    model = build_model("cnn5", num_classes=10, in_channels=1, input_size=28)
    block1 = 2 * 24 * 24 * 10 * 25  # conv 1->10 5x5 on 28x28
    block2 = 2 * 8 * 8 * 20 * 10 * 25  # conv 10->20 5x5 on 12x12
    block3 = 2 * 320 * 50
    classifier = 2 * 50 * 10
    heads = {"block1": 2 * 40 * 10, "block2": 2 * 80 * 10, "block3": 2 * 50 * 10}  # pooled 2x2
    costs = level_costs(model, CUTS)
    assert [c.client_flops for c in costs] == [
        block1 + heads["block1"],
        block1 + block2 + heads["block1"] + heads["block2"],
        block1 + block2 + block3 + sum(heads.values()),
    ]
    assert [c.server_flops for c in costs] == [
        block2 + block3 + classifier + heads["block2"] + heads["block3"],
        block3 + classifier + heads["block3"],
        classifier,
    ]
    # Local-loss SFL at block1 runs no server head: less server work than FedSplitX level 1.
    (early,) = level_costs(model, ["block1"])
    assert early.server_flops == block2 + block3 + classifier


# --- the strategy on cnn5 -------------------------------------------------------------------------


def cnn5() -> SplitNet:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return build_model("cnn5", num_classes=10, in_channels=1, input_size=28)


class SendOnly:
    """A channel that records what is sent and fails if anyone waits for a gradient."""

    def __init__(self) -> None:
        self.sent: list[tuple[torch.Tensor, torch.Tensor, int, int]] = []

    def exchange(self, z: torch.Tensor, y: torch.Tensor, step: int, steps: int) -> torch.Tensor:
        raise AssertionError("a FedSplitX client never waits for a gradient")

    def send(self, z: torch.Tensor, y: torch.Tensor, step: int, steps: int) -> None:
        assert not z.requires_grad
        self.sent.append((z, y, step, steps))


def batches(n: int, rows: int = 8) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randn(rows, 1, 28, 28, generator=g), torch.randint(0, 10, (rows,), generator=g))
        for _ in range(n)
    ]


def test_registry_builds_both_and_the_traits_say_local_loss() -> None:
    fsx = build_strategy("fedsplitx", {"cuts": "block1,block3", "default_level": 2})
    assert isinstance(fsx, FedSplitX) and fsx.cuts == ("block1", "block3")
    server = fsx.server
    assert server is not None and not server.waits_for_gradient and server.partial_client_updates
    lls = build_strategy("local_loss_sfl", {})
    assert isinstance(lls, FedSplitX) and lls.name == "local_loss_sfl"
    model = cnn5()
    assert server.batch_cuts(model, "block1") == ("block1", "block3")
    assert build_strategy("fedsplitx", {}).server.batch_cuts(model, "block1") == CUTS
    assert lls.server.batch_cuts(model, "block2") == ("block2",)
    # The level a client without a capability gets, whether uploads are partial, the banner.
    assert server.default_level == 2 and not lls.server.partial_client_updates
    assert server.cut_label("block1") == "levels block1,block3"
    assert build_strategy("fedsplitx", {}).server.cut_label("block1") == "levels at every cut"
    assert lls.server.cut_label("block2") == "block2"
    assert build_strategy("sfl_v2").server.batch_cuts(model, "block2") == ("block2",)
    with pytest.raises(ValueError):
        build_strategy("fedsplitx", {"cuts": "block3,block1"}).server.batch_cuts(model, "block1")


def test_initial_blobs_cover_the_deepest_client_and_the_shallowest_server() -> None:
    model = cnn5()
    blobs = FedSplitX().initial_weights(model, "block1")
    client = blobs[BlobRef(CLIENT_PART)]
    server = blobs[BlobRef(SERVER_PART)]
    assert {n.split(".")[1] for n in client} == {"0", "1", "2"}  # up to block3
    assert {n.split(".")[1] for n in server if n.startswith("blocks.")} == {"1", "2", "3"}
    assert {n.split(".")[1] for n in server if n.startswith("heads.")} == {"block2", "block3"}
    assert {n.split(".")[1] for n in blobs[BlobRef(AUX_PART)]} == set(CUTS)
    one = build_strategy("local_loss_sfl").initial_weights(model, "block2")
    assert {n.split(".")[1] for n in one[BlobRef(CLIENT_PART)]} == {"0", "1"}
    assert not [n for n in one[BlobRef(SERVER_PART)] if n.startswith("heads.")]
    assert {n.split(".")[1] for n in one[BlobRef(AUX_PART)]} == {"block2"}


def test_client_round_minimises_its_heads_summed_loss_and_only_sends() -> None:
    model, reference = cnn5(), cnn5()
    data = batches(1)
    channel = SendOnly()
    hyper = Hyper(lr=0.1)
    result = FedSplitX().client_round(
        LocalRound(model, "block2", data, 1, channel, hyper, ClientContext("c", 0))
    )
    # What one SGD step on l(a_1) + l(a_2) does, computed here by hand.
    x, y = data[0]
    reference.train()
    z1 = reference.blocks[0](x)
    z2 = reference.blocks[1](z1)
    a1, a2 = reference.head("block1")(z1), reference.head("block2")(z2)
    loss = F.cross_entropy(a1, y) + F.cross_entropy(a2, y)
    loss.backward()
    expected = {
        name: p.detach() - 0.1 * p.grad
        for name, p in reference.named_parameters()
        if p.grad is not None
        and (name.startswith(("blocks.0.", "blocks.1.", "heads.block1.", "heads.block2.")))
    }
    got = {**result.client_weights, **result.aux_weights}
    assert set(got) >= set(expected)
    assert set(result.client_weights) == set(client_state(model, "block2"))
    assert set(result.aux_weights) == set(head_state(model, ["block1", "block2"]))
    for name, value in expected.items():
        assert torch.allclose(got[name], value, atol=1e-6), name
    # The activation at the client's cut went out, detached, with its labels.
    (z, labels, step, steps) = channel.sent[0]
    assert z.shape == (8, *model.cut_shape("block2")) and torch.equal(labels, y)
    assert (step, steps) == (0, 1)
    assert result.metrics["level"] == 2.0 and result.metrics["train_samples"] == 8.0


def test_server_step_trains_from_each_batchs_own_cut() -> None:
    model = cnn5()
    server = ServerModel(model, "block1")
    before = {n: v.clone() for n, v in server.state_dict().items()}
    optimizer = torch.optim.SGD(server.parameters(), lr=0.1)
    z = torch.randn(8, *model.cut_shape("block2"))
    y = torch.randint(0, 10, (8,))
    results = FedSplitX().server.step(server, optimizer, [CohortBatch("c", z, y, cut="block2")])
    after = server.state_dict()
    changed = {n.split(".")[1] for n in after if not torch.equal(after[n], before[n])}
    # A level-2 batch trains block3, the classifier and a_3; not block2 nor a_2.
    assert changed == {"2", "3", "block3"}
    grad, loss, correct = results[0]
    assert grad.numel() == 0 and math.isfinite(loss) and 0 <= correct <= 8

    # The step it took: one SGD step on l(a_3) + l(output) from block2's activation; the
    # loss it reports is the output's.
    ref = ServerModel(cnn5(), "block1")
    out, aux = ref.forward_from(z, "block2")
    assert set(aux) == {"block3"}
    assert loss == pytest.approx(float(F.cross_entropy(out.detach(), y)), rel=1e-5)
    (F.cross_entropy(aux["block3"], y) + F.cross_entropy(out, y)).backward()
    for name, p in ref.named_parameters():
        if p.grad is not None:
            assert torch.allclose(after[name], p.detach() - 0.1 * p.grad, atol=1e-6), name


def test_local_loss_sfl_server_trains_no_heads() -> None:
    model = cnn5()
    server = ServerModel(model, "block1")
    heads_before = {n: v.clone() for n, v in server.state_dict().items() if "heads" in n}
    optimizer = torch.optim.SGD(server.parameters(), lr=0.1)
    z = torch.randn(8, *model.cut_shape("block1"))
    y = torch.randint(0, 10, (8,))
    build_strategy("local_loss_sfl").server.step(server, optimizer, [CohortBatch("c", z, y)])
    after = server.state_dict()
    assert all(torch.equal(after[n], v) for n, v in heads_before.items())


def two_level_round(strategy: FedSplitX) -> tuple[VersionWeights, VersionWeights]:
    """`strategy` (over cnn5 at block1/2/3) aggregating one round: client a at level 1 (10 rows,
    every tensor +1), client b at level 2 (30 rows, +4), and the replica (+8), which ran a's
    10 rows from block1 and b's 30 from block2. Returns (previous, aggregated)."""
    model = cnn5()
    bound = strategy.for_model(lambda: model, "block1")
    previous = bound.initial_weights(model, "block1")

    def shifted(state: dict[str, torch.Tensor], by: float) -> dict[str, torch.Tensor]:
        return {n: v + by if v.is_floating_point() else v for n, v in state.items()}

    level1 = ClientUpdate(
        "a",
        100,
        1,
        shifted(client_state(model, "block1"), 1.0),
        shifted(head_state(model, ["block1"]), 1.0),
        metrics={"train_samples": 10.0},
    )
    level2 = ClientUpdate(
        "b",
        100,
        1,
        shifted(client_state(model, "block2"), 4.0),
        shifted(head_state(model, ["block1", "block2"]), 4.0),
        metrics={"train_samples": 30.0},
    )
    server = previous[BlobRef(SERVER_PART)]
    replica = ShardReplica(0, 40, shifted(server, 8.0), cut_samples={"block1": 10, "block2": 30})
    return previous, bound.aggregate(previous, [level1, level2], [replica])


def test_aggregate_weighs_clients_and_the_replica_per_tensor() -> None:
    previous, out = two_level_round(FedSplitX())
    merged = {**out[BlobRef(AUX_PART)], **out[BlobRef(SERVER_PART)], **out[BlobRef(CLIENT_PART)]}
    base = {n: v for blob in previous.values() for n, v in blob.items()}

    def moved(name: str) -> float:
        return float((merged[name] - base[name]).flatten()[0])

    # block1 and a_1: both clients, 10 vs 30 rows.
    assert moved("blocks.0.conv.weight") == pytest.approx((10 * 1 + 30 * 4) / 40)
    assert moved("heads.block1.fc.weight") == pytest.approx((10 * 1 + 30 * 4) / 40)
    # block2 and a_2: client b (30 rows) and the replica (the 10 level-1 rows).
    assert moved("blocks.1.conv.weight") == pytest.approx((30 * 4 + 10 * 8) / 40)
    assert moved("heads.block2.fc.weight") == pytest.approx((30 * 4 + 10 * 8) / 40)
    # block3, a_3, classifier: only the replica trained them (held by one holder).
    assert moved("blocks.2.fc.weight") == pytest.approx(8.0)
    assert moved("heads.block3.fc.weight") == pytest.approx(8.0)
    assert moved("blocks.3.fc.weight") == pytest.approx(8.0)
    # A tensor in two blobs has one value.
    name = "blocks.1.conv.weight"
    assert torch.equal(out[BlobRef(CLIENT_PART)][name], out[BlobRef(SERVER_PART)][name])


def test_aggregate_needs_the_model_structure() -> None:
    model = cnn5()
    previous = FedSplitX().initial_weights(model, "block1")
    update = ClientUpdate("a", 1, 1, client_state(model, "block1"))
    with pytest.raises(RuntimeError, match="for_model"):
        FedSplitX().aggregate(previous, [update], [])
