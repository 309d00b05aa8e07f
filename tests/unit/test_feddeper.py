"""FedDeper: the rule's pure functions by hand, one client round against a hand-run step, the
personalised model kept in the client's memory across rounds, the aggregation, and the
personalised accuracy the aggregator records from the clients."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from pydantic import ValidationError
from torch import nn
from torch.nn import functional as F

from broker.store import CLIENT_PART, SERVER_PART, BlobRef
from models.split import SplitNet
from models.state import load_partial
from services.aggregator.evaluation import VersionEval
from services.aggregator.metrics import build_record
from services.algorithms.base import (
    ClientContext,
    ClientUpdate,
    Hyper,
    LocalRound,
    RoundResult,
    full_state,
)
from services.algorithms.fedavg import FedAvg
from services.algorithms.feddeper import (
    PERSONAL,
    FedDeper,
    ProximalRule,
    upload_state,
)
from services.algorithms.registry import build_strategy
from services.config.root import Settings
from services.data.loaders import Dataset, load_dataset
from tests.unit.test_client import run_client
from tests.unit.test_client_peers import (
    PeerScript,
    hyper,
    make_settings,
    max_diff,
    round_batches,
    seeded_model,
)

CLIENT = BlobRef(CLIENT_PART)


# --- the rule, by hand -----------------------------------------------------------------------
# The design's two steps written out (SGD without momentum), the references of the tests below.
def personal_step(
    v: torch.Tensor, grad: torch.Tensor, x: torch.Tensor, *, lr: float, rho: float
) -> torch.Tensor:
    """`v - lr * (g(v) + rho * (v - x))`."""
    return v - lr * ProximalRule(rho=rho, lam=0.0).personal_direction(grad, v, x)


def local_step(u: torch.Tensor, grad: torch.Tensor, *, lr: float) -> torch.Tensor:
    """`u - lr * g(u)`."""
    return u - lr * grad


def test_personal_step_by_hand() -> None:
    v, g, x = torch.tensor([1.0, 2.0]), torch.tensor([0.5, -1.0]), torch.tensor([0.0, 1.0])
    # g + rho (v - x) = [0.5 + 0.5*1, -1 + 0.5*1] = [1.0, -0.5]; v - 0.1 * that:
    out = personal_step(v, g, x, lr=0.1, rho=0.5)
    torch.testing.assert_close(out, torch.tensor([0.9, 2.05]))
    # rho = 0 is plain SGD; v = x makes the pull vanish.
    torch.testing.assert_close(personal_step(v, g, x, lr=0.1, rho=0.0), torch.tensor([0.95, 2.1]))
    torch.testing.assert_close(personal_step(x, g, x, lr=0.1, rho=9.0), x - 0.1 * g)


def test_local_step_by_hand() -> None:
    u, g = torch.tensor([1.0, 2.0]), torch.tensor([0.5, -1.0])
    torch.testing.assert_close(local_step(u, g, lr=0.1), torch.tensor([0.95, 2.1]))


def test_upload_by_hand() -> None:
    u, v, x = torch.tensor([3.0, -1.0]), torch.tensor([2.0, 0.0]), torch.tensor([1.0, 1.0])
    # v - x = [1, -1]; u - 0.5 * [1, -1] = [2.5, -0.5]
    torch.testing.assert_close(
        ProximalRule(rho=0.0, lam=0.5).upload(u, v, x), torch.tensor([2.5, -0.5])
    )
    torch.testing.assert_close(
        ProximalRule(rho=0.0, lam=0.0).upload(u, v, x), u
    )  # lam = 0: FedAvg's upload


def test_upload_state_applies_the_rule_to_parameters_and_keeps_us_buffers() -> None:
    u = {"w": torch.tensor([3.0]), "running_var": torch.tensor([0.1]), "n": torch.tensor(7)}
    v = {"w": torch.tensor([2.0]), "running_var": torch.tensor([5.0]), "n": torch.tensor(9)}
    x = {"w": torch.tensor([1.0]), "running_var": torch.tensor([1.0]), "n": torch.tensor(3)}
    out = upload_state(ProximalRule(rho=0.1, lam=0.5), u, v, x, {"w"})
    torch.testing.assert_close(out["w"], torch.tensor([2.5]))
    # 0.1 - 0.5 * (5 - 1) would be a negative variance: buffers are u's.
    assert torch.equal(out["running_var"], u["running_var"])
    assert int(out["n"]) == 7
    with pytest.raises(ValueError, match="same tensor names"):
        upload_state(ProximalRule(0.1, 0.5), u, {"w": v["w"]}, x, {"w"})


# --- parameters and registry -----------------------------------------------------------------
def test_registry_builds_feddeper_with_validated_params() -> None:
    strategy = build_strategy("feddeper", {"rho": 0.3, "lam": 0.25, "rule": "proximal"})
    assert isinstance(strategy, FedDeper)
    assert strategy.rule == ProximalRule(rho=0.3, lam=0.25)
    assert strategy.server is None
    defaults = build_strategy("feddeper")
    assert isinstance(defaults, FedDeper) and defaults.rule == ProximalRule(rho=0.1, lam=0.5)
    for bad in ({"rho": -1.0}, {"rule": "alternating"}, {"mu": 1.0}):
        with pytest.raises(ValidationError):
            build_strategy("feddeper", bad)


def test_only_feddeper_takes_its_personal_accuracy_from_the_clients() -> None:
    assert FedDeper.traits.personal_on_clients
    assert not FedAvg.traits.personal_on_clients


# --- a client's round ------------------------------------------------------------------------
def tiny_model(seed: int) -> SplitNet:
    torch.manual_seed(seed)
    return SplitNet(
        [("b1", nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))), ("b2", nn.Linear(4, 2))],
        input_shape=(3,),
        num_classes=2,
    )


def batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(5, 3, generator=g), torch.tensor([0, 1, 1, 0, 1])


class Seen:
    """A `local_accuracy` stand-in that remembers the weights of the model it was given."""

    def __init__(self, accuracy: float) -> None:
        self.accuracy = accuracy
        self.states: list[dict[str, torch.Tensor]] = []

    def __call__(self, module: nn.Module) -> float:
        assert isinstance(module, SplitNet)
        self.states.append(full_state(module))
        return self.accuracy


class NoChannel:
    """FedDeper has no server side: any smashed data is a bug."""

    def exchange(self, z: torch.Tensor, y: torch.Tensor, step: int, steps: int) -> torch.Tensor:
        raise AssertionError("FedDeper sent smashed data")

    def send(self, z: torch.Tensor, y: torch.Tensor, step: int, steps: int) -> None:
        raise AssertionError("FedDeper sent smashed data")


def run_round(
    strategy: FedDeper,
    model: SplitNet,
    batches: list[tuple[torch.Tensor, torch.Tensor]],
    context: ClientContext,
    lr: float,
) -> RoundResult:
    result = strategy.client_round(
        LocalRound(model, "b1", iter(batches), len(batches), NoChannel(), Hyper(lr=lr), context)
    )
    assert result.metrics["train_samples"] == 5.0 * len(batches)
    return result


def block_grads(model: nn.Module, xb: torch.Tensor, yb: torch.Tensor) -> dict[str, torch.Tensor]:
    params = {n: p for n, p in model.named_parameters() if n.startswith("blocks.")}
    grads = torch.autograd.grad(F.cross_entropy(model(xb), yb), list(params.values()))
    return dict(zip(params, grads, strict=True))


def memory_state(memory: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k[len(PERSONAL) :]: t for k, t in memory.items() if k.startswith(PERSONAL)}


def test_one_step_matches_the_rule_applied_by_hand() -> None:
    lr, rule = 0.1, ProximalRule(rho=0.5, lam=0.3)
    model, personal = tiny_model(0), tiny_model(1)
    x = full_state(model)
    v = full_state(personal)
    seen = Seen(0.75)
    context = ClientContext(
        "c", 3, memory={PERSONAL + k: t for k, t in v.items()}, local_accuracy=seen
    )
    xb, yb = batch(0)

    # By hand: both gradients on the same minibatch, one plain step each, then the upload.
    u_ref, v_ref = copy.deepcopy(model), copy.deepcopy(personal)
    u_ref.train()
    v_ref.train()
    g_u, g_v = block_grads(u_ref, xb, yb), block_grads(v_ref, xb, yb)
    names = list(g_u)
    u_buffers, v_buffers = full_state(u_ref), full_state(v_ref)  # running stats after the forward
    v_after = {n: personal_step(v[n], g_v[n], x[n], lr=lr, rho=rule.rho) for n in names}
    u_after = {n: local_step(x[n], g_u[n], lr=lr) for n in names}

    result = run_round(FedDeper(rule=rule), model, [(xb, yb)], context, lr)
    upload = result.client_weights

    remembered = memory_state(context.memory)
    assert set(upload) == set(x) == set(remembered)
    for n in names:
        torch.testing.assert_close(remembered[n], v_after[n])
        torch.testing.assert_close(upload[n], u_after[n] - rule.lam * (v_after[n] - x[n]))
        torch.testing.assert_close(full_state(model)[n], u_after[n])  # the model is u
    for n in set(x) - set(names):  # BatchNorm buffers: u's in the upload, v's in memory
        torch.testing.assert_close(upload[n], u_buffers[n])
        torch.testing.assert_close(remembered[n], v_buffers[n])
    # The personalised accuracy is v's, measured after its step.
    (measured,) = seen.states
    assert result.metrics["personal_accuracy"] == result.metrics["report.personal_accuracy"] == 0.75
    for n in names:
        torch.testing.assert_close(measured[n], v_after[n])


def test_v_starts_at_the_first_global_model_and_persists_across_rounds() -> None:
    strategy = FedDeper(rule=ProximalRule(rho=0.1, lam=0.5))
    memory: dict[str, torch.Tensor] = {}
    model = tiny_model(0)
    x0 = full_state(model)

    # Round 0 with lr = 0: v is initialised to the global model it received, and stays there.
    run_round(strategy, model, [batch(0)], ClientContext("c", 0, memory=memory), lr=0.0)
    v0 = memory_state(memory)
    assert set(v0) == set(x0)
    for n in x0:
        if x0[n].is_floating_point() and not n.endswith(("running_mean", "running_var")):
            torch.testing.assert_close(v0[n], x0[n])

    # Round 1 trains: v moves away from x0.
    run_round(strategy, model, [batch(1), batch(2)], ClientContext("c", 1, memory=memory), lr=0.2)
    v1 = memory_state(memory)
    assert max(float((v1[n] - v0[n]).abs().max()) for n in v0 if v0[n].is_floating_point()) > 1e-3

    # Round 2 gets a new global model x2 and does not train: v is round 1's, not x2, and the
    # upload is x2 - lam (v1 - x2).
    fresh = tiny_model(7)
    x2 = full_state(fresh)
    context = ClientContext("c", 2, memory=memory)
    upload = run_round(strategy, fresh, [batch(3)], context, lr=0.0).client_weights
    v2 = memory_state(memory)
    params = {n for n, _ in fresh.named_parameters() if n.startswith("blocks.")}
    for n in params:
        torch.testing.assert_close(v2[n], v1[n])
        torch.testing.assert_close(upload[n], x2[n] - 0.5 * (v1[n] - x2[n]))
        assert not torch.allclose(v2[n], x2[n])


def test_a_memory_that_does_not_fit_the_model_is_replaced_by_the_global_model() -> None:
    model = tiny_model(0)
    x = full_state(model)
    memory = {PERSONAL + "blocks.9.weight": torch.ones(3), "other": torch.zeros(1)}
    run_round(FedDeper(), model, [batch(0)], ClientContext("c", 0, memory=memory), lr=0.0)
    assert set(memory_state(memory)) == set(x)
    assert "other" in memory  # not FedDeper's key: left alone


# --- aggregation and the recorded metrics ----------------------------------------------------
def test_aggregate_is_the_samples_weighted_mean_of_the_uploads() -> None:
    server = BlobRef(SERVER_PART)
    previous = {CLIENT: {"w": torch.tensor([9.0, 9.0])}, server: {"s": torch.tensor([1.0])}}
    updates = [
        ClientUpdate("a", 1, 1, {"w": torch.tensor([0.0, 4.0])}),
        ClientUpdate("b", 3, 1, {"w": torch.tensor([4.0, 0.0])}),
    ]
    out = FedDeper().aggregate(previous, updates, [])
    # 0.25 * [0, 4] + 0.75 * [4, 0] = [3, 1]
    torch.testing.assert_close(out[CLIENT]["w"], torch.tensor([3.0, 1.0]))
    assert out[server] is previous[server]
    with pytest.raises(ValueError, match="no client updates"):
        FedDeper().aggregate(previous, [], [])


def test_record_takes_the_clients_personal_accuracy_when_the_models_live_there() -> None:
    updates = [
        ClientUpdate("a", 100, 1, {}, metrics={"personal_accuracy": 0.9}),
        ClientUpdate("b", 300, 1, {}, metrics={"personal_accuracy": 0.5}),
        ClientUpdate("c", 100, 1, {}, metrics={}),  # reported nothing: not counted
    ]
    evaluation = VersionEval(
        global_accuracy=0.6, global_loss=1.0, personal_accuracy=0.65, test_samples=10
    )

    def record(from_clients: bool) -> tuple[float, dict[str, float]]:
        r = build_record(
            version=2,
            round_index=0,
            elapsed_s=1.0,
            updates=updates,
            round_s=1.0,
            evaluation=evaluation,
            personal_from_clients=from_clients,
        )
        return r.personal_accuracy, r.extra

    personal, extra = record(True)
    assert personal == pytest.approx(0.7)  # a plain mean over clients, as the evaluator's
    assert extra["global_personal_accuracy"] == 0.65
    personal, extra = record(False)
    assert personal == 0.65 and "global_personal_accuracy" not in extra
    updates[:] = updates[2:]
    assert math.isnan(record(True)[0])


# --- the real client keeps v across rounds ---------------------------------------------------
def reference_uploads(
    settings: Settings, dataset: Dataset, index: int, rounds: int, *, keep_memory: bool
) -> list[dict[str, torch.Tensor]]:
    """The strategy driven by hand as the fake service does: each version's model is the
    client's previous upload (one client)."""
    strategy = build_strategy("feddeper", settings.algorithm.params())
    model = seeded_model(settings)
    memory: dict[str, torch.Tensor] = {}
    uploads = []
    for r in range(rounds):
        batches = round_batches(settings, dataset, index, r)
        context = ClientContext("c", r, memory=memory if keep_memory else {})
        result = strategy.client_round(
            LocalRound(
                model, "", iter(batches), len(batches), NoChannel(), hyper(settings), context
            )
        )
        uploads.append(result.client_weights)
        load_partial(model, result.client_weights)
    return uploads


def test_the_client_keeps_v_in_its_memory_from_round_to_round(job: str) -> None:
    dataset = load_dataset("fashion_mnist_sample", None)
    # Default parameters: the scripted service's Welcome names the algorithm but sends no
    # `params.*`, so the client runs the defaults.
    settings = make_settings(job, algorithm={"name": "feddeper"})
    run = run_client(settings, dataset, PeerScript(rounds=2))

    updates = run.log.updates
    assert [u.round for u in updates] == [0, 1]
    kept = reference_uploads(settings, dataset, 3, 2, keep_memory=True)
    forgot = reference_uploads(settings, dataset, 3, 2, keep_memory=False)
    for update, want in zip(updates, kept, strict=True):
        assert max_diff(dict(update.client_weights), want) <= 1e-5
        assert 0.0 <= update.metrics["personal_accuracy"] <= 1.0
    # Round 0 cannot tell (v starts at the global model either way); round 1 can.
    assert max_diff(kept[0], forgot[0]) == 0.0
    assert max_diff(kept[1], forgot[1]) > 1e-3
