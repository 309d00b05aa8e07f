"""FedDeper against the rules its paper's text states (Zhou et al., arXiv 2210.03444; the text
in ../shared/papers/feddeper.txt lacks Section III's equations, so only what the prose says is
pinned here): the personalised model optimises the local objective (plus the penalty rho), the
upload subtracts the personalised model from the original one, equal clients are averaged
as in Problem (1) (1/n), and the server samples m distinct clients uniformly."""

from __future__ import annotations

from collections import Counter

import torch

from broker.store import CLIENT_PART, SERVER_PART, BlobRef
from services.aggregator.round_gate import sample_cohort
from services.algorithms.base import ClientUpdate
from services.algorithms.feddeper import FedDeper, ProximalRule


def test_without_the_penalty_the_personal_step_is_the_local_gradient() -> None:
    # "the personalized local model is obtained by directly optimizing the local objective":
    # rho = 0 leaves g untouched, whatever v and x are.
    rule = ProximalRule(rho=0.0, lam=0.5)
    g, v, x = torch.tensor([1.0, -2.0]), torch.tensor([3.0, 3.0]), torch.tensor([0.0, 1.0])
    torch.testing.assert_close(rule.personal_direction(g, v, x), torch.tensor([1.0, -2.0]))


def test_the_penalty_rho_pulls_the_personal_model_towards_x() -> None:
    # g + rho (v - x) with rho = 2: [1 + 2*(3-0), -2 + 2*(3-1)] = [7, 2].
    rule = ProximalRule(rho=2.0, lam=0.5)
    g, v, x = torch.tensor([1.0, -2.0]), torch.tensor([3.0, 3.0]), torch.tensor([0.0, 1.0])
    torch.testing.assert_close(rule.personal_direction(g, v, x), torch.tensor([7.0, 2.0]))


def test_the_upload_subtracts_the_personal_model_from_the_original_one() -> None:
    # "the globalized local model is obtained by subtracting the personalized local model from
    # the original one": lam = 1, u = [4, 2], v = [3, 5], x = [1, 1]:
    # y = u - (v - x) = [4 - 2, 2 - 4] = [2, -2]; lam = 0.5: [4 - 1, 2 - 2] = [3, 0].
    u, v, x = torch.tensor([4.0, 2.0]), torch.tensor([3.0, 5.0]), torch.tensor([1.0, 1.0])
    torch.testing.assert_close(ProximalRule(0.0, 1.0).upload(u, v, x), torch.tensor([2.0, -2.0]))
    torch.testing.assert_close(ProximalRule(0.0, 0.5).upload(u, v, x), torch.tensor([3.0, 0.0]))


def test_clients_of_equal_size_are_averaged_as_in_problem_1() -> None:
    # Problem (1) is f = 1/n sum_i f_i: with equal |D_i| (equal shards) the samples-weighted
    # average is the plain mean, ([0, 3] + [3, 0] + [6, 6]) / 3 = [3, 3].
    client, server = BlobRef(CLIENT_PART), BlobRef(SERVER_PART)
    previous = {client: {"w": torch.tensor([9.0, 9.0])}, server: {"s": torch.tensor([1.0])}}
    updates = [
        ClientUpdate("a", 5, 1, {"w": torch.tensor([0.0, 3.0])}),
        ClientUpdate("b", 5, 1, {"w": torch.tensor([3.0, 0.0])}),
        ClientUpdate("c", 5, 1, {"w": torch.tensor([6.0, 6.0])}),
    ]
    out = FedDeper().aggregate(previous, updates, [])
    torch.testing.assert_close(out[client]["w"], torch.tensor([3.0, 3.0]))


def test_the_server_samples_m_distinct_clients_uniformly() -> None:
    # "The server uniformly samples a subset of m clients": m = 10 of n = 100, distinct, and
    # over 2,000 rounds each client is drawn about 2,000 * 10 / 100 = 200 times (binomial
    # std sqrt(2000 * 0.1 * 0.9) = 13.4; 140..260 is more than 4 std either side).
    pool = [f"c{i:03d}" for i in range(100)]
    counts: Counter[str] = Counter()
    for k in range(2000):
        cohort = sample_cohort(pool, 10, seed=0, round_index=k)
        assert len(cohort) == len(set(cohort)) == 10
        assert set(cohort) <= set(pool)
        counts.update(cohort)
    assert set(counts) == set(pool)
    assert all(140 <= c <= 260 for c in counts.values())
