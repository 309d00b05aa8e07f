"""SplitGP's math against small cases worked out by hand."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from broker.store import AUX_PART, CLIENT_PART, BlobRef
from models.split import SplitNet
from services.algorithms.base import ClientUpdate, CohortBatch
from services.algorithms.splitgp import (
    RowResults,
    SplitGP,
    client_objective,
    entropy,
    mix,
    personalise,
    stays_local,
    sweep,
)
from services.client.inference import SplitPredictor


def t(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


# --- lambda-mixing ------------------------------------------------------------------------------


def test_mix_is_lambda_own_plus_one_minus_lambda_shared() -> None:
    own = {"w": t(1.0, 3.0), "n": torch.tensor(7)}
    shared = {"w": t(5.0, -1.0), "n": torch.tensor(2)}
    out = mix(own, shared, 0.2)
    # 0.2 * 1 + 0.8 * 5 = 4.2 ; 0.2 * 3 + 0.8 * -1 = -0.2
    assert torch.allclose(out["w"], t(4.2, -0.2))
    assert out["n"].item() == 7  # a counter is the client's own
    assert torch.equal(mix(own, shared, 1.0)["w"], own["w"])
    assert torch.equal(mix(own, shared, 0.0)["w"], shared["w"])


def test_mix_refuses_a_bad_lambda_and_mismatched_states() -> None:
    with pytest.raises(ValueError, match="lambda"):
        mix({"w": t(1.0)}, {"w": t(1.0)}, 1.5)
    with pytest.raises(ValueError, match="names"):
        mix({"w": t(1.0)}, {"v": t(1.0)}, 0.5)


def update(client: str, samples: int, phi: float, h: float) -> ClientUpdate:
    return ClientUpdate(
        client=client,
        samples=samples,
        base_version=1,
        client_weights={"blocks.0.w": t(phi)},
        aux_weights={"heads.b0.w": t(h)},
    )


def test_personalise_mixes_participants_and_the_unsampled_with_the_alpha_mean() -> None:
    previous = {
        BlobRef(CLIENT_PART): {"blocks.0.w": t(0.0)},
        BlobRef(AUX_PART): {"heads.b0.w": t(0.0), "heads.b1.w": t(9.0)},
        # c sat this round out; it has personal blobs from an earlier one.
        BlobRef(CLIENT_PART, "c"): {"blocks.0.w": t(10.0)},
        BlobRef(AUX_PART, "c"): {"heads.b0.w": t(-10.0)},
    }
    out = personalise(previous, [update("a", 1, 0.0, 2.0), update("b", 3, 4.0, 6.0)], 0.2)
    # alpha = (1/4, 3/4): phi_bar = 0.75 * 4 = 3 ; h_bar = 0.25 * 2 + 0.75 * 6 = 5
    assert torch.allclose(out[BlobRef(CLIENT_PART)]["blocks.0.w"], t(3.0))
    assert torch.allclose(out[BlobRef(AUX_PART)]["heads.b0.w"], t(5.0))
    assert torch.equal(out[BlobRef(AUX_PART)]["heads.b1.w"], t(9.0))  # other heads kept
    # phi_a = 0.2 * 0 + 0.8 * 3 = 2.4 ; phi_b = 0.2 * 4 + 0.8 * 3 = 3.2
    assert torch.allclose(out[BlobRef(CLIENT_PART, "a")]["blocks.0.w"], t(2.4))
    assert torch.allclose(out[BlobRef(CLIENT_PART, "b")]["blocks.0.w"], t(3.2))
    # h_a = 0.2 * 2 + 0.8 * 5 = 4.4 ; h_b = 0.2 * 6 + 0.8 * 5 = 5.2
    assert torch.allclose(out[BlobRef(AUX_PART, "a")]["heads.b0.w"], t(4.4))
    assert torch.allclose(out[BlobRef(AUX_PART, "b")]["heads.b0.w"], t(5.2))
    # c, as if it had taken no step: 0.2 * 10 + 0.8 * 3 = 4.4 ; 0.2 * -10 + 0.8 * 5 = 2
    assert torch.allclose(out[BlobRef(CLIENT_PART, "c")]["blocks.0.w"], t(4.4))
    assert torch.allclose(out[BlobRef(AUX_PART, "c")]["heads.b0.w"], t(2.0))
    assert {r.owner for r in out} == {"global", "a", "b", "c"}  # no blob for absent clients


def test_lambda_zero_is_multi_exit_one_shared_client_model() -> None:
    out = personalise({}, [update("a", 1, 0.0, 2.0), update("b", 1, 4.0, 6.0)], 0.0)
    for owner in ("a", "b"):
        assert torch.allclose(out[BlobRef(CLIENT_PART, owner)]["blocks.0.w"], t(2.0))
        assert torch.allclose(out[BlobRef(AUX_PART, owner)]["heads.b0.w"], t(4.0))


# --- the (1 - gamma) scaling --------------------------------------------------------------------

# A one-weight-per-class server: logits = W z with W = [[1], [3]], z = 2, label 0. Then
# logits = (2, 6), p = (1, e^4) / (1 + e^4), dl/dlogits = p - onehot(0) = (-q, q) with
# q = e^4 / (1 + e^4); dl/dz = W^T (-q, q) = 2q; dl/dW = (-q, q) * z = (-2q, 2q).
Q = math.exp(4) / (1 + math.exp(4))


def linear_server() -> nn.Linear:
    server = nn.Linear(1, 2, bias=False)
    with torch.no_grad():
        server.weight.copy_(torch.tensor([[1.0], [3.0]]))
    return server


@pytest.mark.parametrize("gamma", [0.0, 0.25, 0.5, 1.0])
def test_server_gradient_and_theta_step_are_scaled_by_one_minus_gamma(gamma: float) -> None:
    server = linear_server()
    optimizer = torch.optim.SGD(server.parameters(), lr=0.1)
    z, y = torch.tensor([[2.0]]), torch.tensor([0])
    [(grad, loss, _)] = SplitGP(gamma=gamma).server.step(
        server, optimizer, [CohortBatch("a", z, y)]
    )
    s = 1.0 - gamma
    assert grad.item() == pytest.approx(s * 2 * Q, rel=1e-5)
    expected_w = [1.0 - 0.1 * s * (-2 * Q), 3.0 - 0.1 * s * (2 * Q)]
    assert server.weight.detach().flatten().tolist() == pytest.approx(expected_w, rel=1e-5)
    # The reported loss is the server's own, unscaled: -log p_0 = log(1 + e^4).
    assert loss == pytest.approx(math.log(1 + math.exp(4)), rel=1e-5)


def test_folded_batches_get_their_own_scaled_gradient_and_one_scaled_step() -> None:
    # Two one-row batches, z = 2 (label 0) and z = 1 (label 1). For z = 1: logits (1, 3),
    # r = e^2 / (1 + e^2), dl/dlogits = (1 - r, r - 1), dl/dz = 1 - r + 3(r - 1) = 2(r - 1),
    # dl/dW = (1 - r, r - 1). One step on the concatenation: mean of the two rows' dl/dW.
    r = math.exp(2) / (1 + math.exp(2))
    server = linear_server()
    optimizer = torch.optim.SGD(server.parameters(), lr=0.1)
    zs = [torch.tensor([[2.0]]), torch.tensor([[1.0]])]
    ys = [torch.tensor([0]), torch.tensor([1])]
    batches = [CohortBatch("a", z, y) for z, y in zip(zs, ys, strict=True)]
    results = SplitGP(gamma=0.5).server.step(server, optimizer, batches)
    assert results[0][0].item() == pytest.approx(0.5 * 2 * Q, rel=1e-5)
    assert results[1][0].item() == pytest.approx(0.5 * 2 * (r - 1), rel=1e-5)
    mean_grad_w = [(-2 * Q + 1 - r) / 2, (2 * Q + r - 1) / 2]
    expected_w = [1.0 - 0.1 * 0.5 * mean_grad_w[0], 3.0 - 0.1 * 0.5 * mean_grad_w[1]]
    assert server.weight.detach().flatten().tolist() == pytest.approx(expected_w, rel=1e-5)


def test_client_objective_adds_gamma_head_gradient_to_the_returned_server_gradient() -> None:
    # Head logits = V z with V = [[1], [3]] as above: dl_h/dz = 2q at z = 2, label 0.
    z = torch.tensor([[2.0]], requires_grad=True)
    head = linear_server()
    server_grad = torch.tensor([[0.7]])  # what the worker returned, already (1 - gamma)-scaled
    objective = client_objective(head(z), torch.tensor([0]), z, server_grad, 0.25)
    objective.backward()
    assert z.grad is not None
    assert z.grad.item() == pytest.approx(0.25 * 2 * Q + 0.7, rel=1e-5)
    # The head's own parameters get gamma times their gradient: dl_h/dV = (-2q, 2q).
    assert head.weight.grad is not None
    got = head.weight.grad.flatten().tolist()
    assert got == pytest.approx([0.25 * -2 * Q, 0.25 * 2 * Q], rel=1e-5)


# --- the entropy rule ---------------------------------------------------------------------------


def test_entropy_of_small_softmaxes() -> None:
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0], [0.0, math.log(3.0), -1e4, -1e4]])
    e = entropy(logits)
    assert e[0].item() == pytest.approx(math.log(4))
    # p = (1/4, 3/4, 0, 0): E = -(1/4 log 1/4 + 3/4 log 3/4), the zeros contributing nothing.
    assert e[1].item() == pytest.approx(-(0.25 * math.log(0.25) + 0.75 * math.log(0.75)))
    assert entropy(torch.tensor([[50.0, 0.0]]))[0].item() == pytest.approx(0.0, abs=1e-18)


def test_a_row_exactly_at_the_threshold_stays_local() -> None:
    # Two equal logits: E = log 2 exactly (in float64); at E_th = log 2 the client answers.
    e = entropy(torch.tensor([[1.0, 1.0], [0.0, 0.1], [3.0, 0.0]]))
    assert e[0].item() == math.log(2)
    assert stays_local(e, math.log(2)).tolist() == [True, True, True]
    assert stays_local(e, math.nextafter(math.log(2), 0.0)).tolist() == [False, True, True]
    assert stays_local(torch.tensor([0.5, 0.5000001, 0.4999]), 0.5).tolist() == [
        True,
        False,
        True,
    ]


def test_split_prediction_takes_the_server_answer_for_offloaded_rows_in_order() -> None:
    # The head is the identity: the inputs are its logits.
    blocks = [("a", nn.Identity()), ("b", nn.Linear(3, 3))]
    model = SplitNet(
        blocks, input_shape=(3,), num_classes=3, head_factory=lambda _s, _n: nn.Identity()
    )
    head = torch.tensor([[5.0, 0.0, 0.0], [0.0, 0.0, 1.0], [0.0, 1.0, 0.0]])
    server = torch.tensor([[0.0, 9.0, 0.0], [9.0, 0.0, 0.0]])  # rows 1 and 2
    threshold = float(entropy(head[:1])[0])  # row 0 stays local, rows 1 and 2 are less sure
    prediction = SplitPredictor(model, "a", lambda _z: server, threshold).predict(head)
    assert prediction.offloaded.tolist() == [False, True, True]
    assert prediction.labels.tolist() == [0, 1, 0]
    with pytest.raises(ValueError, match="offloaded"):
        SplitPredictor(model, "a", lambda _z: server[:1], threshold).predict(head)


def test_sweep_counts_accuracy_and_offloaded_fraction_per_threshold() -> None:
    entropies = torch.tensor([0.0, 0.3, 0.6, 1.2])
    head_ok = torch.tensor([True, True, False, False])
    server_ok = torch.tensor([False, True, True, False])
    points = sweep(RowResults(entropies, head_ok, server_ok), [0.0, 0.3, 1.0, 5.0])
    # E_th = 0: row 0 local (right), rows 1-3 server (right, right, wrong): 3/4, 3/4 sent.
    # E_th = 0.3: rows 0, 1 local (both right), 2 server right, 3 wrong: 3/4, 2/4 sent.
    # E_th = 1.0: rows 0-2 local (right, right, wrong), 3 server wrong: 2/4, 1/4 sent.
    # E_th = 5: all local: 2/4, none sent.
    assert [(p.accuracy, p.offloaded) for p in points] == [
        (0.75, 0.75),
        (0.75, 0.5),
        (0.5, 0.25),
        (0.5, 0.0),
    ]
