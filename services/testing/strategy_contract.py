"""The strategy contract: what every algorithm must do for the roles, checked on each name a
strategy class registers, with given (default: its defaults) parameters, on `fakes.tiny_model`.

- registration: the class itself registers the name, and builds a frozen dataclass of that name
  whose server side, if any, is a `ServerSide`;
- its initial weights are the model's own tensors;
- aggregating identical updates returns them;
- a client round against a fake channel uploads finite tensors of the model, talking to the
  worker as its server side says (a gradient per step, fire-and-forget, or not at all);
- the server step returns, per batch, a gradient shaped like the activations (an empty one when
  the client waits for none); a U-shaped server side's forward and the shared backward give
  each batch its gradient;
- it runs asynchronously, or refuses to with a reason naming it when it registered sync-only.

Each check raises `AssertionError` saying what broke; none needs pytest, a data set or a broker.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import ClassVar

import torch

from broker.store import AUX_PART, CLIENT_PART, SERVER_PART, BlobRef
from models.parts import ServerModel
from models.split import SplitNet
from services.algorithms.base import (
    AlgorithmSpec,
    ClientContext,
    ClientUpdate,
    CohortBatch,
    Hyper,
    LocalRound,
    ServerSide,
    ShardReplica,
    StrategyBase,
    VersionWeights,
)
from services.algorithms.registry import specs_in
from services.algorithms.ushape import backward_open
from services.testing.fakes import CUT, ROWS, FakeChannel, batches, tiny_model

ModelFactory = Callable[..., SplitNet]  # called with heads=: whether the strategy uses them


@dataclass(frozen=True)
class Case:
    """One registered name under test: its spec, the parameters it is built with, the model
    (a factory taking `heads`) and the job's cut."""

    spec: AlgorithmSpec
    params: Mapping[str, object] = field(default_factory=lambda: MappingProxyType({}))
    model: ModelFactory = tiny_model
    cut: str = CUT

    def build(self) -> StrategyBase:
        return self.spec.build(self.params)

    def net(self) -> SplitNet:
        return self.model(heads=self.spec.strategy.traits.uses_heads)

    def __str__(self) -> str:
        return self.spec.name


def expect(condition: bool, message: str) -> None:
    """`assert`, kept under `python -O`."""
    if not condition:
        raise AssertionError(message)


def merged(blobs: VersionWeights) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for state in blobs.values():
        out.update(state)
    return out


# --- the checks ---------------------------------------------------------------------------------
def check_registration(case: Case) -> None:
    spec, strategy = case.spec, case.build()
    expect(spec in specs_in(spec.strategy), f"{spec.name} is not registered by its own class")
    expect(type(strategy) is spec.strategy, f"{spec.name} builds a {type(strategy).__name__}")
    expect(strategy.name == spec.name, f"{spec.name} builds a strategy named {strategy.name!r}")
    params = vars(type(strategy)).get("__dataclass_params__")
    expect(params is not None and params.frozen, f"{spec.name} is no frozen dataclass")
    server = strategy.server
    expect(server is None or isinstance(server, ServerSide), f"{spec.name}: server {server!r}")


def check_initial_weights(case: Case) -> None:
    net = case.net()
    blobs = case.build().initial_weights(net, case.cut)
    state = net.state_dict()
    expect(BlobRef(CLIENT_PART) in blobs, f"{case}: version 1 has no client/global")
    for ref, tensors in blobs.items():
        expect(bool(tensors), f"{case}: {ref} is empty")
        for name, tensor in tensors.items():
            expect(name in state, f"{case}: {ref}: {name} is not a tensor of the model")
            torch.testing.assert_close(tensor, state[name], rtol=0, atol=0)


def check_identical_updates(case: Case) -> None:
    net = case.net()
    strategy = case.build().for_model(lambda: net, case.cut)
    previous = strategy.initial_weights(net, case.cut)
    shifted = {
        n: t + 0.5 if t.is_floating_point() else t.clone() for n, t in merged(previous).items()
    }

    def part(ref: BlobRef) -> dict[str, torch.Tensor]:
        return {n: shifted[n] for n in previous.get(ref, {})}

    splits = strategy.server is not None
    updates = [
        ClientUpdate(
            client,
            samples=ROWS,
            base_version=1,
            client_weights=part(BlobRef(CLIENT_PART)),
            aux_weights=part(BlobRef(AUX_PART)) if splits else {},
            metrics={"train_samples": float(ROWS)},
        )
        for client in ("a", "b", "c")
    ]
    replicas = [ShardReplica(s, ROWS, part(BlobRef(SERVER_PART))) for s in (0, 1)]
    out = strategy.aggregate(previous, updates, replicas if splits else [])
    before = merged(previous)
    for client in ("a", "b", "c"):  # what each client is handed next: its own blob, or global
        handed = out.get(BlobRef(CLIENT_PART, client), out[BlobRef(CLIENT_PART)])
        for name, tensor in handed.items():
            torch.testing.assert_close(tensor, shifted[name], msg=lambda m: f"{case}: {m}")
    if splits:
        for name, tensor in out[BlobRef(SERVER_PART)].items():
            torch.testing.assert_close(tensor, shifted[name], msg=lambda m: f"{case}: {m}")
    for ref, tensors in out.items():  # elsewhere: the uploads, or what was there
        for name, tensor in tensors.items():
            same = torch.equal(tensor, shifted[name]) or torch.equal(tensor, before[name])
            expect(same, f"{case}: {ref} {name} is neither the uploads' value nor the previous")


def check_client_round(case: Case) -> None:
    net = case.net()
    strategy = case.build()
    for state in strategy.initial_weights(net, case.cut).values():
        net.load_state_dict({**net.state_dict(), **state})
    channel, steps = FakeChannel(), 2
    context = ClientContext("c1", 1, local_accuracy=lambda _m: 1.0)
    result = strategy.client_round(
        LocalRound(net, case.cut, batches(steps), steps, channel, Hyper(lr=0.01), context)
    )
    state = net.state_dict()
    expect(bool(result.client_weights), f"{case}: the round uploads no client weights")
    for name, tensor in {**result.client_weights, **result.aux_weights}.items():
        expect(name in state, f"{case}: uploads {name}, not a tensor of the model")
        expect(tensor.shape == state[name].shape, f"{case}: {name} has shape {tensor.shape}")
        expect(bool(torch.isfinite(tensor.float()).all()), f"{case}: {name} is not finite")
    trained = result.metrics.get("train_samples")
    expect(trained == steps * ROWS, f"{case}: train_samples {trained}, trained {steps * ROWS}")
    server, talked = strategy.server, (len(channel.exchanged), len(channel.sent))
    if server is None:
        expect(talked == (0, 0), f"{case}: no server side, yet the client sent {talked}")
    elif server.waits_for_gradient:
        expect(talked == (steps, 0), f"{case}: (exchanged, sent) {talked}, not a gradient a step")
    else:
        expect(talked == (0, steps), f"{case}: (exchanged, sent) {talked}, not a send a step")


def check_server_step(case: Case) -> None:
    server = case.build().server
    if server is None:
        return
    net = case.net()
    replica = ServerModel(copy.deepcopy(net), case.cut)
    optimizer = torch.optim.SGD(replica.parameters(), lr=0.01)
    with torch.no_grad():
        data = [(net.client_blocks(case.cut)(x), y) for x, y in batches(2)]
    cohort = [CohortBatch(f"c{i}", z, y, weight=float(ROWS)) for i, (z, y) in enumerate(data)]
    zs = [z for z, _ in data]
    results = server.step(replica, optimizer, cohort)
    expect(len(results) == len(cohort), f"{case}: {len(results)} results for {len(cohort)}")
    for (grad, loss, correct), batch in zip(results, cohort, strict=True):
        if server.waits_for_gradient:
            shape = batch.activations.shape
            expect(grad.shape == shape, f"{case}: dL/dz of shape {grad.shape}, not {shape}")
            expect(bool(torch.isfinite(grad).all()), f"{case}: dL/dz is not finite")
        else:
            expect(grad.numel() == 0, f"{case}: a gradient the client does not wait for")
        expect(loss == loss and 0 <= correct <= ROWS, f"{case}: loss {loss}, correct {correct}")
    if server.u_shaped:
        opened = server.forward(replica, zs, [float(ROWS)] * len(zs))
        expect(len(opened.outputs) == len(zs), f"{case}: {len(opened.outputs)} outputs")
        back = backward_open(optimizer, opened, [torch.ones_like(o) for o in opened.outputs])
        shapes = [None if g is None else g.shape for g in back]
        expect(shapes == [z.shape for z in zs], f"{case}: U-shaped dL/dz of shapes {shapes}")


def check_async(case: Case) -> None:
    refusal = case.build().async_refusal()
    if case.spec.sync_only:
        expect(bool(refusal) and case.spec.name in str(refusal), f"{case}: refusal {refusal!r}")
    else:
        expect(refusal is None, f"{case} registered async-capable, yet refuses: {refusal}")


CHECKS: tuple[Callable[[Case], None], ...] = (
    check_registration,
    check_initial_weights,
    check_identical_updates,
    check_client_round,
    check_server_step,
    check_async,
)


# --- running them -------------------------------------------------------------------------------
def cases(
    strategy: type[StrategyBase],
    params: Mapping[str, object] | None = None,
    *,
    model: ModelFactory = tiny_model,
    cut: str = CUT,
) -> list[Case]:
    """One case per name `strategy` registers; `AssertionError` when it registers none."""
    specs = specs_in(strategy)
    expect(bool(specs), f"{strategy.__qualname__} registers no algorithm: decorate it @algorithm")
    return [Case(spec, MappingProxyType(dict(params or {})), model, cut) for spec in specs]


def check_strategy(
    strategy: type[StrategyBase],
    params: Mapping[str, object] | None = None,
    *,
    model: ModelFactory = tiny_model,
    cut: str = CUT,
) -> None:
    """Every check on every name `strategy` registers; the first failure raises."""
    for case in cases(strategy, params, model=model, cut=cut):
        for check in CHECKS:
            check(case)


class StrategyContract:
    """The checks as a pytest class (pytest collects a subclass named `Test...`):

        class TestMine(StrategyContract):
            strategy = Mine
            params = {"keep": 0.5}  # optional; the model and the cut too

    Each test runs one check on every name the class registers. The class imports nothing of
    pytest: a plugin's tests need it, SplitMQ does not."""

    strategy: ClassVar[type[StrategyBase]]
    params: ClassVar[Mapping[str, object]] = MappingProxyType({})
    cut: ClassVar[str] = CUT

    def model(self, *, heads: bool) -> SplitNet:
        """The model the checks run on, with auxiliary heads or none (override for another)."""
        return tiny_model(heads=heads)

    def _run(self, check: Callable[[Case], None]) -> None:
        for case in cases(self.strategy, self.params, model=self.model, cut=self.cut):
            check(case)

    def test_registration(self) -> None:
        self._run(check_registration)

    def test_initial_weights_are_the_models_own(self) -> None:
        self._run(check_initial_weights)

    def test_aggregating_identical_updates_returns_them(self) -> None:
        self._run(check_identical_updates)

    def test_a_client_round_against_a_fake_channel(self) -> None:
        self._run(check_client_round)

    def test_server_step_gradients_have_the_activations_shape(self) -> None:
        self._run(check_server_step)

    def test_async_is_supported_or_refused_with_a_reason(self) -> None:
        self._run(check_async)
