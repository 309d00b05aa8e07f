"""The SplitGP strategy: its client round, worker step, aggregation and per-version metrics,
checked against plain SFL / local training run here on copies of the same model."""

from __future__ import annotations

import copy
from collections.abc import Iterator

import pytest
import torch
from torch.nn import functional as F
from torch.testing import assert_close

from broker.store import AUX_PART, CLIENT_PART, SERVER_PART, BlobRef
from models.parts import ServerModel
from models.split import SplitNet
from models.state import client_state, head_state
from services.algorithms.base import (
    ClientContext,
    ClientUpdate,
    CohortBatch,
    Hyper,
    LocalRound,
    ShardReplica,
)
from services.algorithms.registry import build_strategy
from services.algorithms.sfl import SFL
from services.algorithms.splitgp import SplitGP
from services.common.jobmodel import job_model
from tests.unit.test_worker_support import CUT, make_settings

HYPER = Hyper(lr=0.1)


@pytest.fixture(autouse=True)
def one_torch_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def seeded_model(seed: int = 0) -> SplitNet:
    torch.manual_seed(seed)
    return job_model(make_settings("j", algorithm={"name": "splitgp"}))


def batches(n: int = 3, rows: int = 8) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(3)
    return [
        (torch.randn(rows, 1, 28, 28, generator=gen), torch.randint(0, 10, (rows,), generator=gen))
        for _ in range(n)
    ]


class FixedChannel:
    """Returns a fixed gradient for every batch and records what it was sent."""

    def __init__(self, scale: float) -> None:
        self.scale = scale
        self.sent: list[torch.Tensor] = []

    def exchange(self, z: torch.Tensor, y: torch.Tensor, step: int, steps: int) -> torch.Tensor:
        self.sent.append(z)
        return torch.full_like(z, self.scale)

    def send(self, z: torch.Tensor, y: torch.Tensor, step: int, steps: int) -> None:
        raise AssertionError("SplitGP waits for every gradient")


def test_params_are_validated_and_registered() -> None:
    strategy = build_strategy("splitgp", {"gamma": 0.3, "lam": 0.1, "entropy_threshold": 1.0})
    assert isinstance(strategy, SplitGP)
    assert (strategy.gamma, strategy.lam, strategy.entropy_threshold) == (0.3, 0.1, 1.0)
    assert build_strategy("splitgp") == SplitGP(gamma=0.5, lam=0.2, entropy_threshold=0.5)
    with pytest.raises(ValueError, match="gamma"):
        build_strategy("splitgp", {"gamma": 1.5})
    assert strategy.server.split_inference and not SFL().server.split_inference


def test_gamma_zero_client_round_is_sfl_and_leaves_the_head_alone() -> None:
    model = seeded_model()
    reference = copy.deepcopy(model)
    head_before = head_state(model, [CUT])
    head_before = {k: v.clone() for k, v in head_before.items()}
    data = batches()
    context = ClientContext("c", 0)
    result = SplitGP(gamma=0.0).client_round(
        LocalRound(model, CUT, data, len(data), FixedChannel(0.01), HYPER, context)
    )
    expected = SFL().client_round(
        LocalRound(reference, CUT, data, len(data), FixedChannel(0.01), HYPER, context)
    )
    for name, tensor in expected.client_weights.items():
        assert_close(result.client_weights[name], tensor, msg=name)
    assert set(result.aux_weights) == set(head_before)
    for name, tensor in head_before.items():
        assert_close(result.aux_weights[name], tensor, msg=name)
    assert result.metrics["train_samples"] == 24.0


def test_gamma_one_client_round_is_local_training_of_body_and_head() -> None:
    model = seeded_model()
    reference = copy.deepcopy(model)
    data = batches()
    result = SplitGP(gamma=1.0).client_round(
        LocalRound(model, CUT, data, len(data), FixedChannel(0.0), HYPER, ClientContext("c", 0))
    )
    body, head = reference.client_blocks(CUT), reference.head(CUT)
    optimizer = torch.optim.SGD([*body.parameters(), *head.parameters()], lr=HYPER.lr)
    for x, y in data:
        loss = F.cross_entropy(head(body(x)), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    for name, tensor in client_state(reference, CUT).items():
        assert_close(result.client_weights[name], tensor, msg=name)
    for name, tensor in head_state(reference, [CUT]).items():
        assert_close(result.aux_weights[name], tensor, msg=name)


def test_server_step_is_sfl_step_scaled_by_one_minus_gamma() -> None:
    model = seeded_model()
    ours, theirs = (ServerModel(copy.deepcopy(model), CUT) for _ in range(2))
    # Plain SGD: a step scaled by s moves the weights s times as far.
    opt_ours = torch.optim.SGD(ours.parameters(), lr=0.1)
    opt_theirs = torch.optim.SGD(theirs.parameters(), lr=0.1)
    # Parameters only: BatchNorm's running statistics do not depend on the loss.
    before = {k: v.detach().clone() for k, v in theirs.named_parameters()}
    gen = torch.Generator().manual_seed(5)
    z = torch.randn(8, *model.cut_shape(CUT), generator=gen)
    y = torch.randint(0, 10, (8,), generator=gen)
    batch = [CohortBatch("c", z, y)]
    ((grad, loss, correct),) = SplitGP(gamma=0.75).server.step(ours, opt_ours, batch)
    ((sfl_grad, sfl_loss, sfl_correct),) = SFL().server.step(theirs, opt_theirs, batch)
    assert_close(grad, 0.25 * sfl_grad)
    assert loss == pytest.approx(sfl_loss) and correct == sfl_correct
    after_ours, after_theirs = dict(ours.named_parameters()), dict(theirs.named_parameters())
    for name, old in before.items():
        moved = after_ours[name].detach() - old
        assert_close(moved, 0.25 * (after_theirs[name].detach() - old), msg=name)


def test_aggregate_averages_theta_by_replica_samples_and_personalises_clients() -> None:
    model = seeded_model()
    strategy = SplitGP(lam=0.2)
    previous = strategy.initial_weights(model, CUT)
    server = previous[BlobRef(SERVER_PART)]
    replicas = [
        ShardReplica(0, 10, {k: torch.ones_like(v) for k, v in server.items()}),
        ShardReplica(1, 30, {k: torch.zeros_like(v) for k, v in server.items()}),
        ShardReplica(2, 0, {k: torch.full_like(v, 9.0) for k, v in server.items()}),
    ]
    phi = previous[BlobRef(CLIENT_PART)]
    h = head_state(model, [CUT])
    updates = [
        ClientUpdate("a", 100, 1, {k: v + 1 for k, v in phi.items()}, h),
        ClientUpdate("b", 100, 1, {k: v - 1 for k, v in phi.items()}, h),
    ]
    out = strategy.aggregate(previous, updates, replicas)
    for name, tensor in out[BlobRef(SERVER_PART)].items():
        if tensor.is_floating_point():  # 10/40 * 1 + 30/40 * 0; the idle shard left out
            assert_close(tensor, torch.full_like(tensor, 0.25), msg=name)
    name = next(k for k, v in phi.items() if v.is_floating_point())
    assert_close(out[BlobRef(CLIENT_PART)][name], phi[name])  # mean of +1 and -1
    # 0.2 * (phi + 1) + 0.8 * phi = phi + 0.2
    assert_close(out[BlobRef(CLIENT_PART, "a")][name], phi[name] + 0.2)
    assert_close(out[BlobRef(CLIENT_PART, "b")][name], phi[name] - 0.2)
    assert set(out[BlobRef(AUX_PART, "a")]) == set(h)
    assert set(out[BlobRef(AUX_PART)]) == {k for k in previous[BlobRef(AUX_PART)]}


def test_personal_metrics_at_extreme_thresholds() -> None:
    model = seeded_model()
    strategy = SplitGP(entropy_threshold=100.0, sweep=(0.0, 100.0))
    blobs = strategy.initial_weights(model, CUT)
    # Client "a" has a personal head that always says class 3, whatever the input.
    head = {k: torch.zeros_like(v) for k, v in head_state(model, [CUT]).items()}
    bias = next(k for k in head if k.endswith("fc.bias"))
    head[bias][3] = 50.0
    blobs[BlobRef(AUX_PART, "a")] = head
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(40, 1, 28, 28, generator=gen)
    y = torch.tensor([3, 5] * 20)
    metrics = strategy.personal_metrics(copy.deepcopy(model), blobs, x, y, {"a": [3]})
    # Its local test set is class 3 only: the head is right on all of it, wrong elsewhere.
    assert metrics["splitgp.head_local"] == 1.0
    assert metrics["splitgp.head_ood"] == 0.0
    assert metrics["splitgp.head_global"] == 0.5
    # E_th = 100 keeps everything on the client; so does the sweep's 100 ...
    assert metrics["splitgp.offload_global"] == 0.0
    assert metrics["splitgp.split_global"] == metrics["splitgp.head_global"]
    assert metrics["splitgp.sweep.100.offload_local"] == 0.0
    # ... and E_th = 0 sends every row with any doubt (all: the head is sure, but not
    # infinitely) to theta, whose answers are then the split answers.
    assert metrics["splitgp.sweep.0.offload_global"] == 1.0
    assert metrics["splitgp.sweep.0.split_global"] == metrics["splitgp.theta_global"]
    assert metrics["splitgp.sweep.0.split_local"] == metrics["splitgp.theta_local"]
    # Strategies without the hook report nothing.
    assert SFL().personal_metrics(model, blobs, x, y, {"a": [3]}) == {}
