"""MiniBatch-SFL's rules as Huang, Tian and Tang write them, pinned on cases small enough to
compute by hand (the numbers in the comments), not by calling the code under test.

Server of the step tests: one linear map R^2 -> R without bias, w_s = [1, 2], and the loss
h(w_s; z, y) = mean((w_s . z - y)^2), so dh/dw_s = 2 (w_s.z - y) z and dh/dz = 2 (w_s.z - y) w_s.
Client 1: z_1 = [1, 0], y_1 = 0: w.z = 1, h = 1, dh/dw = [2, 0], dh/dz = [2, 4].
Client 2: z_2 = [0, 1], y_2 = 0: w.z = 2, h = 4, dh/dw = [0, 4], dh/dz = [4, 8].
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from services.algorithms.base import CLIENT, ClientUpdate, CohortBatch, average_round
from services.algorithms.minibatch_sfl import MiniBatchSFL
from services.algorithms.sfl import SFL
from services.data.partition import label_ratio

LR = 0.1


def squared(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((out.squeeze(1) - y.float()) ** 2).mean()


def linear_server() -> tuple[nn.Linear, torch.optim.Optimizer]:
    server = nn.Linear(2, 1, bias=False)
    with torch.no_grad():
        server.weight.copy_(torch.tensor([[1.0, 2.0]]))
    return server, torch.optim.SGD(server.parameters(), lr=LR)


def two_clients(p1: float, p2: float) -> list[CohortBatch]:
    return [
        CohortBatch("c1", torch.tensor([[1.0, 0.0]]), torch.tensor([0]), weight=p1),
        CohortBatch("c2", torch.tensor([[0.0, 1.0]]), torch.tensor([0]), weight=p2),
    ]


def test_server_step_is_equation_3_weighted_by_p_n() -> None:
    # Eq. (3), p = (1, 3): w_s - eta (1 [2, 0] + 3 [0, 4]) / 4 = [1, 2] - 0.1 [0.5, 3]
    # = [0.95, 1.7]. Weighting by rows (one each) would give [0.9, 1.8] instead.
    server, optimizer = linear_server()
    rows = MiniBatchSFL().server.step(server, optimizer, two_clients(1.0, 3.0), loss=squared)
    assert server.weight.detach().flatten().tolist() == pytest.approx([0.95, 1.7])
    grads = [g.flatten().tolist() for g, _, _ in rows]
    # Each client gets dh(w_s; z_n)/dz_n at the pre-update w_s = [1, 2], unweighted.
    assert grads[0] == pytest.approx([2.0, 4.0])
    assert grads[1] == pytest.approx([4.0, 8.0])
    assert [loss for _, loss, _ in rows] == pytest.approx([1.0, 4.0])


def test_sfl_v2_step_weights_the_batches_by_their_rows() -> None:
    # SFL-V2's step on the same two batches (folded): rows 1 and 1, p ignored:
    # [1, 2] - 0.1 ([2, 0] + [0, 4]) / 2 = [0.9, 1.8].
    server, optimizer = linear_server()
    SFL().server.step(server, optimizer, two_clients(1.0, 3.0), loss=squared)
    assert server.weight.detach().flatten().tolist() == pytest.approx([0.9, 1.8])


def test_server_forward_is_per_client_batch() -> None:
    # h(w_s; z_n) sees client n's batch alone: with BatchNorm (momentum 1: the running mean is
    # the last batch's mean) the forwards on [0, 2] then [10, 14] leave the mean of the last,
    # 12; one forward on the concatenation would leave (0 + 2 + 10 + 14) / 4 = 6.5.
    server = nn.Sequential(nn.BatchNorm1d(1, momentum=1.0), nn.Linear(1, 1))
    optimizer = torch.optim.SGD(server.parameters(), lr=LR)
    batches = [
        CohortBatch("c1", torch.tensor([[0.0], [2.0]]), torch.tensor([0, 0]), weight=1.0),
        CohortBatch("c2", torch.tensor([[10.0], [14.0]]), torch.tensor([0, 0]), weight=1.0),
    ]
    MiniBatchSFL().server.step(server, optimizer, batches, loss=squared)
    bn = server[0]
    assert isinstance(bn, nn.BatchNorm1d)
    assert bn.running_mean is not None
    assert bn.running_mean.tolist() == pytest.approx([12.0])


def test_synchronisation_is_equation_5_weighted_by_dataset_size() -> None:
    # Eq. (5) with p_n = D_n / sum D: D = (1, 3), v_c = (0, 4) -> (1 * 0 + 3 * 4) / 4 = 3.
    updates = [
        ClientUpdate("c1", 1, 1, {"w": torch.tensor([0.0])}),
        ClientUpdate("c2", 3, 1, {"w": torch.tensor([4.0])}),
    ]
    out = MiniBatchSFL().aggregate({}, updates, [])
    assert out[CLIENT]["w"].tolist() == pytest.approx([3.0])
    assert average_round({}, updates, [])[CLIENT]["w"].tolist() == pytest.approx([3.0])


def test_label_ratio_is_the_papers_non_iid_split() -> None:
    # Labels 0,0,1,1,2,2,3,3 over N = 2. r = 1: everything sorted by label and cut into equal
    # blocks, so client 0 holds labels {0, 1} and client 1 holds {2, 3}.
    labels = np.array([0, 0, 1, 1, 2, 2, 3, 3])
    parts = label_ratio(labels, 2, 1.0, seed=0)
    assert [sorted(set(labels[p].tolist())) for p in parts] == [[0, 1], [2, 3]]
    # r = 0.5: 4 samples spread uniformly (2 each) and 4 sorted and cut in two blocks (2
    # each): 4 samples per client, every sample dealt once.
    parts = label_ratio(labels, 2, 0.5, seed=0)
    assert [len(p) for p in parts] == [4, 4]
    assert sorted(np.concatenate(parts).tolist()) == list(range(8))
