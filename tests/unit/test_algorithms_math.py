from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from services.algorithms.averaging import heteroavg, weighted_average
from services.algorithms.sfl import weighted_step


def test_weighted_average_by_hand() -> None:
    a = {"w": torch.tensor([1.0, 2.0]), "n": torch.tensor(3)}
    b = {"w": torch.tensor([3.0, 6.0]), "n": torch.tensor(5)}
    out = weighted_average([a, b], [1, 3])
    # 0.25*[1,2] + 0.75*[3,6] = [2.5, 5.0]; counters take the maximum.
    assert torch.equal(out["w"], torch.tensor([2.5, 5.0]))
    assert int(out["n"]) == 5


def test_weighted_average_rejects_mismatches() -> None:
    with pytest.raises(ValueError, match="different tensor names"):
        weighted_average([{"a": torch.zeros(1)}, {"b": torch.zeros(1)}], [1, 1])
    with pytest.raises(ValueError, match="shape"):
        weighted_average([{"a": torch.zeros(1)}, {"a": torch.zeros(2)}], [1, 1])
    with pytest.raises(ValueError, match="sum must be > 0"):
        weighted_average([{"a": torch.zeros(1)}], [0])


def test_heteroavg_overlapping_holders_keeps_unheld_previous() -> None:
    shallow = {"b1": torch.tensor([2.0])}
    deep = {"b1": torch.tensor([4.0]), "b2": torch.tensor([10.0])}
    previous = {"b1": torch.tensor([0.0]), "b2": torch.tensor([0.0]), "b3": torch.tensor([7.0])}
    out = heteroavg([(shallow, 1), (deep, 1)], previous)
    assert torch.equal(out["b1"], torch.tensor([3.0]))  # both hold it
    assert torch.equal(out["b2"], torch.tensor([10.0]))  # only the deep one holds it
    assert torch.equal(out["b3"], torch.tensor([7.0]))  # nobody holds it: old value


def _server() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3))


def test_one_batch_step_matches_manual_sgd_and_scales_the_gradient() -> None:
    server = _server()
    reference = copy.deepcopy(server)
    z = torch.randn(4, 6)
    y = torch.tensor([0, 1, 2, 1])
    opt = torch.optim.SGD(server.parameters(), lr=0.1)
    result = weighted_step(server, opt, [z], [y], [1.0], loss_scale=0.5)

    zz = z.clone().requires_grad_(True)
    loss = F.cross_entropy(reference(zz), y)
    grads = torch.autograd.grad(loss, [zz, *reference.parameters()])
    torch.testing.assert_close(result.grads[0], 0.5 * grads[0])
    for p_new, p_old, g in zip(server.parameters(), reference.parameters(), grads[1:], strict=True):
        torch.testing.assert_close(p_new, p_old - 0.1 * 0.5 * g)
    assert result.losses[0] == pytest.approx(float(loss.detach()))


def test_weighted_step_is_equation_3() -> None:
    server = nn.Sequential(nn.Linear(6, 5), nn.BatchNorm1d(5), nn.ReLU(), nn.Linear(5, 3))
    reference = copy.deepcopy(server)
    zs = [torch.randn(4, 6), torch.randn(3, 6), torch.randn(5, 6)]
    ys = [torch.randint(0, 3, (4,)), torch.randint(0, 3, (3,)), torch.randint(0, 3, (5,))]
    p = [4.0, 3.0, 5.0]
    opt = torch.optim.SGD(server.parameters(), lr=0.2)
    result = weighted_step(server, opt, zs, ys, p)

    # Reference: each client's own loss and gradients at the pre-update weights.
    params = list(reference.parameters())
    step = [torch.zeros_like(q) for q in params]
    for z, y, pn, got in zip(zs, ys, p, result.grads, strict=True):
        zz = z.clone().requires_grad_(True)
        loss = F.cross_entropy(reference(zz), y)
        g = torch.autograd.grad(loss, [zz, *params])
        torch.testing.assert_close(got, g[0])
        for acc, gi in zip(step, g[1:], strict=True):
            acc.add_(gi, alpha=pn / sum(p))
    for p_new, p_old, s in zip(server.parameters(), params, step, strict=True):
        torch.testing.assert_close(p_new, p_old - 0.2 * s)


def test_weighted_step_concat_equals_separate_without_batch_coupling() -> None:
    torch.manual_seed(1)
    server = _server()
    twin = copy.deepcopy(server)
    zs = [torch.randn(4, 6), torch.randn(2, 6)]
    ys = [torch.tensor([0, 1, 2, 0]), torch.tensor([2, 2])]
    a = weighted_step(server, torch.optim.SGD(server.parameters(), lr=0.1), zs, ys, [4, 2])
    b = weighted_step(twin, torch.optim.SGD(twin.parameters(), lr=0.1), zs, ys, [4, 2], concat=True)
    for ga, gb in zip(a.grads, b.grads, strict=True):
        torch.testing.assert_close(ga, gb)
    for pa, pb in zip(server.parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(pa, pb)
