"""The strategy contract: what every registered algorithm (built-in or an installed plugin's)
must do for the roles, checked on each with its default parameters and a real model.

- its initial weights are the model's own tensors;
- aggregating identical updates returns them;
- a client round against a fake channel uploads tensors of the model, talking to the worker
  as its traits say (a gradient per step, fire-and-forget, or not at all);
- a server step returns, per batch, a gradient shaped like the activations (none when the
  client does not wait for one), or refuses when the algorithm has no server side;
- it runs asynchronously, or refuses to with a reason, at load time as the registry says.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping

import pytest
import torch
from pydantic import ValidationError

from broker.store import AUX_PART, CLIENT_PART, SERVER_PART, BlobRef
from models.parts import ServerModel
from models.registry import build_model
from models.split import SplitNet
from services.algorithms.base import (
    AlgorithmSpec,
    ClientContext,
    ClientUpdate,
    CohortBatch,
    Hyper,
    LocalRound,
    ShardReplica,
    StrategyBase,
    VersionWeights,
)
from services.algorithms.registry import BUILTINS, REGISTRY, AlgorithmPluginError, Registry
from services.config.root import Settings

SPECS = [REGISTRY.get(name) for name in REGISTRY.names()]  # each module imported
CUT = "block1"
ROWS = 8


@pytest.fixture(params=SPECS, ids=[s.name for s in SPECS])
def spec(request: pytest.FixtureRequest) -> AlgorithmSpec:
    found: AlgorithmSpec = request.param
    return found


def model() -> SplitNet:
    torch.manual_seed(0)
    return build_model("cnn5")


def batches(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randn(ROWS, 1, 28, 28, generator=g), torch.randint(0, 10, (ROWS,), generator=g))
        for _ in range(steps)
    ]


def bound(spec: AlgorithmSpec, net: SplitNet) -> StrategyBase:
    return spec.build().for_model(lambda: net, CUT)


class FakeTally:
    def metrics(self) -> Mapping[str, float]:
        return {"train_accuracy": 1.0}


class FakeChannel:
    """A worker that answers every batch with a small gradient of the activation's shape."""

    def __init__(self) -> None:
        self.tally = FakeTally()
        self.exchanged: list[tuple[int, ...]] = []
        self.sent: list[tuple[int, ...]] = []

    def exchange(self, z: torch.Tensor, y: torch.Tensor, step: int, steps: int) -> torch.Tensor:
        self.exchanged.append(tuple(z.shape))
        return torch.full_like(z, 1e-3)

    def send(self, z: torch.Tensor, y: torch.Tensor, step: int, steps: int) -> None:
        self.sent.append(tuple(z.shape))


def merged(blobs: VersionWeights) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for state in blobs.values():
        out.update(state)
    return out


def test_every_builtin_name_is_registered_by_its_module() -> None:
    assert {s.name for s in SPECS} >= set(BUILTINS)
    for spec in SPECS:
        assert spec in spec.strategy.registrations  # decorated on the class itself
        assert spec.build().name == spec.name


def test_initial_weights_are_the_models_own(spec: AlgorithmSpec) -> None:
    net = model()
    blobs = spec.build().initial_weights(net, CUT)
    state = net.state_dict()
    assert BlobRef(CLIENT_PART) in blobs
    for ref, tensors in blobs.items():
        assert tensors, f"{ref} is empty"
        for name, tensor in tensors.items():
            assert name in state, f"{ref}: {name} is not a tensor of the model"
            torch.testing.assert_close(tensor, state[name], rtol=0, atol=0)


def test_aggregating_identical_updates_returns_them(spec: AlgorithmSpec) -> None:
    net = model()
    strategy = bound(spec, net)
    previous = strategy.initial_weights(net, CUT)
    shifted = {
        n: t + 0.5 if t.is_floating_point() else t.clone() for n, t in merged(previous).items()
    }

    def part(ref: BlobRef) -> dict[str, torch.Tensor]:
        return {n: shifted[n] for n in previous.get(ref, {})}

    updates = [
        ClientUpdate(
            client,
            samples=ROWS,
            base_version=1,
            client_weights=part(BlobRef(CLIENT_PART)),
            aux_weights=part(BlobRef(AUX_PART)) if strategy.splits else {},
            metrics={"train_samples": float(ROWS)},
        )
        for client in ("a", "b", "c")
    ]
    replicas = [ShardReplica(s, ROWS, part(BlobRef(SERVER_PART))) for s in (0, 1)]
    out = strategy.aggregate(previous, updates, replicas if strategy.splits else [])
    before = merged(previous)
    for client in ("a", "b", "c"):  # what each client is handed next: its own blob, or global
        handed = out.get(BlobRef(CLIENT_PART, client), out[BlobRef(CLIENT_PART)])
        for name, tensor in handed.items():
            torch.testing.assert_close(tensor, shifted[name])
    if strategy.splits:
        for name, tensor in out[BlobRef(SERVER_PART)].items():
            torch.testing.assert_close(tensor, shifted[name])
    for ref, tensors in out.items():  # elsewhere: the uploads, or what was there
        for name, tensor in tensors.items():
            same = torch.equal(tensor, shifted[name]) or torch.equal(tensor, before[name])
            assert same, f"{ref} {name} is neither the uploads' value nor the previous one"


def test_a_client_round_against_a_fake_channel(spec: AlgorithmSpec) -> None:
    net = model()
    strategy = spec.build()
    for state in strategy.initial_weights(net, CUT).values():
        net.load_state_dict({**net.state_dict(), **state})
    channel = FakeChannel()
    steps = 2
    context = ClientContext("c1", 1, local_accuracy=lambda _m: 1.0)
    result = strategy.client_round(
        LocalRound(net, CUT, batches(steps), steps, channel, Hyper(lr=0.01), context)
    )
    state = net.state_dict()
    assert result.client_weights
    for name, tensor in {**result.client_weights, **result.aux_weights}.items():
        assert name in state and tensor.shape == state[name].shape, name
        assert torch.isfinite(tensor.float()).all(), name
    assert result.metrics["train_samples"] == steps * ROWS
    if not strategy.splits:
        assert channel.exchanged == channel.sent == []
    elif strategy.waits_for_gradient:
        assert len(channel.exchanged) == steps and channel.sent == []
    else:
        assert len(channel.sent) == steps and channel.exchanged == []


def test_server_step_gradients_have_the_activations_shape(spec: AlgorithmSpec) -> None:
    net = model()
    strategy = spec.build()
    server = ServerModel(copy.deepcopy(net), CUT)
    optimizer = torch.optim.SGD(server.parameters(), lr=0.01)
    cohort = []
    for i, (x, y) in enumerate(batches(2)):
        with torch.no_grad():
            z = net.client_blocks(CUT)(x)
        cohort.append(CohortBatch(f"c{i}", z, y, weight=float(ROWS)))
    if not strategy.splits:
        with pytest.raises(RuntimeError, match="no server-side model"):
            strategy.server_step(server, optimizer, cohort)
        return
    results = strategy.server_step(server, optimizer, cohort)
    assert len(results) == len(cohort)
    for (grad, loss, correct), batch in zip(results, cohort, strict=True):
        if strategy.waits_for_gradient:
            assert grad.shape == batch.activations.shape
            assert torch.isfinite(grad).all()
        else:
            assert grad.numel() == 0
        assert loss == loss and 0 <= correct <= ROWS


def test_async_is_supported_or_refused_with_a_reason(spec: AlgorithmSpec) -> None:
    refusal = spec.build().async_refusal()
    config = {"algorithm": {"name": spec.name}, "rounds": {"mode": "async"}}
    if spec.sync_only:
        assert refusal and spec.name in refusal
        with pytest.raises(ValidationError, match=f"{spec.name} stays synchronous"):
            Settings.model_validate(config)
    else:
        assert refusal is None
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
