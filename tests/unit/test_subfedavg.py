"""The Sub-FedAvg and Standalone strategies: a client's round (mask memory, re-masking, the
adoption rule in action), the aggregation, and how they reach the registry, the aggregator's
gate and the run's report."""

from __future__ import annotations

import copy
from dataclasses import dataclass

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from broker.store import AUX_PART, CLIENT_PART, SERVER_PART, BlobRef
from models.registry import build_model
from models.split import SplitNet
from services.aggregator.gate import masks_problem
from services.aggregator.metrics import reported_extras
from services.algorithms.base import ClientContext, ClientUpdate, Hyper, LocalRound, ShardReplica
from services.algorithms.registry import build_strategy
from services.algorithms.standalone import Standalone
from services.algorithms.subfedavg import (
    WEIGHT_KEY,
    SubFedAvg,
    SubFedAvgSection,
    first_checkpoint,
)

GLOBAL = BlobRef(CLIENT_PART)
HYPER = Hyper(lr=0.05, momentum=0.5, local_epochs=2)


def model() -> SplitNet:
    torch.manual_seed(0)
    return build_model("cnn5")


def batches(n: int = 8) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(16, 1, 28, 28, generator=g), torch.randint(0, 2, (16,), generator=g))] * n


def strategy(**params: object) -> SubFedAvg:
    return SubFedAvg(config=SubFedAvgSection.model_validate({"prune_percent": 0.2, **params}))


def context(accuracy: float) -> ClientContext:
    return ClientContext("c1", 0, local_accuracy=lambda _m: accuracy)


class NoChannel:
    def exchange(self, z: torch.Tensor, y: torch.Tensor, step: int, steps: int) -> torch.Tensor:
        raise AssertionError("the full-model scope never talks to a worker")

    def send(self, z: torch.Tensor, y: torch.Tensor, step: int, steps: int) -> None:
        raise AssertionError("the full-model scope never talks to a worker")


def run(s: SubFedAvg, net: SplitNet, ctx: ClientContext, steps: int = 8) -> dict[str, float]:
    result = s.client_round(
        LocalRound(net, "block1", iter(batches(steps)), steps, NoChannel(), HYPER, ctx)
    )
    for name, mask in result.masks.items():
        assert mask.dtype == torch.bool
        assert torch.count_nonzero(result.client_weights[name][~mask]) == 0, name
    return dict(result.metrics)


def mask_sparsity(ctx: ClientContext) -> float:
    masks = [m for k, m in ctx.memory.items() if k.startswith(WEIGHT_KEY)]
    return 1 - sum(int(m.sum()) for m in masks) / sum(m.numel() for m in masks)


def test_first_checkpoint_is_the_end_of_the_first_epoch() -> None:
    assert first_checkpoint(50, 5) == 10
    assert first_checkpoint(8, 2) == 4
    assert first_checkpoint(8, 1) == 4  # one epoch: its middle
    assert first_checkpoint(1, 1) == 1


def test_a_client_adopts_a_mask_when_every_condition_holds() -> None:
    ctx = context(accuracy=0.9)
    metrics = run(strategy(acc_thresh=0.5), model(), ctx)
    assert metrics["mask_adopted"] == 1.0 and metrics["mask_distance"] > 0.0001
    # 20% of each layer's weights; the biases and BN are never pruned.
    assert mask_sparsity(ctx) == pytest.approx(0.2, abs=0.01)
    assert 0.15 < metrics["report.param_reduction"] < 0.2
    assert metrics["report.flop_reduction"] == pytest.approx(0.2, abs=0.01)
    assert metrics["report.local_accuracy"] == 0.9


@pytest.mark.parametrize(
    ("params", "accuracy"),
    [
        ({"acc_thresh": 0.95}, 0.9),  # local accuracy not above the threshold
        ({"acc_thresh": 0.5, "dist_thresh": 0.9}, 0.9),  # masks moved too little
        ({"acc_thresh": 0.5, "target": 0.0}, 0.9),  # target already reached
    ],
)
def test_a_client_keeps_its_mask_and_weights_when_a_condition_fails(
    params: dict[str, float], accuracy: float
) -> None:
    ctx = context(accuracy)
    net = model()
    metrics = run(strategy(**params), net, ctx)
    assert metrics["mask_adopted"] == 0.0
    assert mask_sparsity(ctx) == 0.0
    assert metrics["report.param_reduction"] == 0.0
    # A rejected trial is undone: the trained weights are all there.
    assert torch.count_nonzero(net.blocks[0].conv.weight) == net.blocks[0].conv.weight.numel()


def test_the_mask_persists_and_re_masks_the_assigned_weights() -> None:
    ctx = context(accuracy=0.9)
    s = strategy(acc_thresh=0.5, target=0.3)
    net = model()
    run(s, net, ctx)
    kept = {k: m.clone() for k, m in ctx.memory.items()}
    # The next round starts from dense "global" weights: the client's own mask applies again,
    # and training cannot revive a pruned weight.
    fresh = model()
    run(s, fresh, ctx)
    for key, old in kept.items():
        name = key[len(WEIGHT_KEY) :]
        assert not (ctx.memory[key] & ~old).any(), "a pruned weight came back"
        assert torch.count_nonzero(fresh.get_parameter(name)[~old]) == 0, name
    # Second adoption stops at the 30% target (0.2, then 1/8 of the 80% alive).
    assert mask_sparsity(ctx) == pytest.approx(0.3, abs=0.01)


def test_hybrid_prunes_channels_by_bn_scale_in_a_round() -> None:
    ctx = context(accuracy=0.9)
    net = model()
    metrics = run(strategy(mode="hybrid", acc_thresh=0.5, channel_percent=0.3), net, ctx)
    assert metrics["mask_adopted"] == 2.0  # the FC masks and the channels
    assert metrics["report.channel_reduction"] > 0
    channels = ctx.memory["subfedavg.channels.blocks.0.bn"]
    gamma = net.blocks[0].bn.weight.detach()
    assert torch.count_nonzero(gamma[~channels]) == 0
    assert metrics["report.flop_reduction"] > metrics["report.channel_reduction"] / 2


@pytest.mark.parametrize(
    ("params", "evaluations"),
    [
        ({"acc_thresh": 0.5}, 1),  # the accepted trial's model is the final one
        ({"acc_thresh": 0.95}, 2),  # rejected: the restored model is measured again
        ({"acc_thresh": 0.5, "dist_thresh": 0.9}, 1),  # no trial: measured once
        ({"mode": "hybrid", "acc_thresh": 0.5, "channel_percent": 0.3}, 2),  # two trials
    ],
)
def test_each_model_state_is_evaluated_once_and_is_the_personal_accuracy(
    params: dict[str, object], evaluations: int
) -> None:
    """A whole-model round's accuracy after training is measured once: the paper's metric
    (`personal_accuracy`, which the client then does not measure again) and the report's
    column are that one number."""
    seen: list[torch.Tensor] = []

    def accuracy(module: nn.Module) -> float:
        seen.append(torch.cat([p.detach().flatten().clone() for p in module.parameters()]))
        return 0.1 * len(seen) + 0.5

    ctx = ClientContext("c1", 0, local_accuracy=accuracy)
    net = model()
    metrics = run(strategy(**params), net, ctx)
    assert len(seen) == evaluations
    final = torch.cat([p.detach().flatten() for p in net.parameters()])
    # Whatever measured last measured the model as the round leaves it.
    assert torch.equal(seen[-1], final)
    assert metrics["personal_accuracy"] == metrics["report.local_accuracy"] == 0.1 * len(seen) + 0.5


@dataclass
class Tally:
    accuracy: float

    def metrics(self) -> dict[str, float]:
        return {"train_accuracy": self.accuracy}


@dataclass
class ServerChannel:
    """A worker in a box: the server side of a copy of the model, one SGD step per batch."""

    server: nn.Module
    tally: Tally
    calls: int = 0

    def exchange(self, z: torch.Tensor, y: torch.Tensor, step: int, steps: int) -> torch.Tensor:
        self.calls += 1
        zz = z.detach().requires_grad_(True)
        F.cross_entropy(self.server(zz), y).backward()
        assert zz.grad is not None
        return zz.grad

    def send(self, z: torch.Tensor, y: torch.Tensor, step: int, steps: int) -> None:
        raise AssertionError("split Sub-FedAvg waits for gradients")


@pytest.mark.parametrize(("reported", "adopted"), [(0.9, 1.0), (0.3, 0.0)])
def test_client_scope_prunes_only_the_client_side(reported: float, adopted: float) -> None:
    s = strategy(scope="client", acc_thresh=0.5)
    assert s.server is not None and s.server.waits_for_gradient
    net = model()
    channel = ServerChannel(copy.deepcopy(net).server_blocks("block1"), Tally(reported))
    ctx = ClientContext("c1", 0)
    result = s.client_round(LocalRound(net, "block1", iter(batches()), 8, channel, HYPER, ctx))
    assert channel.calls == 8
    assert set(result.masks) == {"blocks.0.conv.weight"}
    assert set(result.client_weights) == {n for n in net.state_dict() if n.startswith("blocks.0.")}
    # The split client cannot evaluate its model: the worker-reported accuracy gates pruning.
    assert result.metrics["mask_adopted"] == adopted
    assert "report.local_accuracy" not in result.metrics


def update(
    client: str, weights: dict[str, torch.Tensor], masks: dict[str, torch.Tensor]
) -> ClientUpdate:
    return ClientUpdate(
        client=client, samples=10, base_version=1, client_weights=weights, masks=masks
    )


def test_aggregate_averages_intersections_and_publishes_personal_models() -> None:
    s = strategy()
    previous = {
        GLOBAL: {"w": torch.tensor([10.0, 20.0, 30.0])},
        BlobRef(CLIENT_PART, "old"): {"w": torch.tensor([1.0, 1.0, 1.0])},
        BlobRef(AUX_PART): {"h": torch.tensor([5.0])},
    }
    a = update("a", {"w": torch.tensor([1.0, 2.0, 0.0])}, {"w": torch.tensor([True, True, False])})
    b = update("b", {"w": torch.tensor([3.0, 0.0, 0.0])}, {"w": torch.tensor([True, False, False])})
    out = s.aggregate(previous, [a, b], [])
    assert torch.equal(out[GLOBAL]["w"], torch.tensor([2.0, 2.0, 30.0]))
    assert torch.equal(out[BlobRef(CLIENT_PART, "a")]["w"], torch.tensor([2.0, 2.0, 0.0]))
    assert torch.equal(out[BlobRef(CLIENT_PART, "b")]["w"], torch.tensor([2.0, 0.0, 0.0]))
    assert BlobRef(CLIENT_PART, "old") not in out  # stale: masked from an older global
    assert out[BlobRef(AUX_PART)] is previous[BlobRef(AUX_PART)]


def test_split_aggregate_averages_the_shard_replicas() -> None:
    s = strategy(scope="client")
    previous = {GLOBAL: {"w": torch.zeros(1)}, BlobRef(SERVER_PART): {"t": torch.zeros(1)}}
    replicas = [
        ShardReplica(0, 30, {"t": torch.tensor([1.0])}),
        ShardReplica(1, 10, {"t": torch.tensor([5.0])}),
    ]
    out = s.aggregate(previous, [update("a", {"w": torch.ones(1)}, {})], replicas)
    assert torch.equal(out[BlobRef(SERVER_PART)]["t"], torch.tensor([2.0]))


def test_standalone_keeps_each_clients_model_and_averages_nothing() -> None:
    previous = {
        GLOBAL: {"w": torch.tensor([0.0])},
        BlobRef(CLIENT_PART, "b"): {"w": torch.tensor([7.0])},
    }
    out = Standalone().aggregate(previous, [update("a", {"w": torch.tensor([1.0])}, {})], [])
    assert torch.equal(out[GLOBAL]["w"], torch.tensor([0.0]))
    assert torch.equal(out[BlobRef(CLIENT_PART, "a")]["w"], torch.tensor([1.0]))
    assert torch.equal(out[BlobRef(CLIENT_PART, "b")]["w"], torch.tensor([7.0]))
    assert Standalone().server is None


def test_registry_builds_both_and_checks_the_params() -> None:
    s = build_strategy("subfedavg", {"mode": "hybrid", "scope": "client", "target": 0.7})
    assert isinstance(s, SubFedAvg) and s.config.mode == "hybrid" and s.server is not None
    assert build_strategy("standalone").name == "standalone"
    with pytest.raises(ValueError, match="prune_percent"):
        build_strategy("subfedavg", {"prune_percent": 1.5})


def test_the_gate_refuses_masks_that_do_not_fit_the_weights() -> None:
    weights = {"w": torch.zeros(2, 3)}
    assert masks_problem({"w": torch.ones(2, 3, dtype=torch.bool)}, weights) is None
    assert "no such tensor" in str(masks_problem({"v": torch.ones(1, dtype=torch.bool)}, weights))
    assert "shape" in str(masks_problem({"w": torch.ones(3, dtype=torch.bool)}, weights))


def test_reported_metrics_reach_the_record_per_client_and_as_a_mean() -> None:
    updates = [
        ClientUpdate("b", 10, 1, {}, metrics={"report.param_reduction": 0.5, "loss": 1.0}),
        ClientUpdate("a", 30, 1, {}, metrics={"report.param_reduction": 0.1}),
    ]
    extras = reported_extras(updates)
    assert extras == {
        "param_reduction.a": 0.1,
        "param_reduction.b": 0.5,
        "param_reduction": pytest.approx(0.3),
    }
