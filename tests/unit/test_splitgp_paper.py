"""SplitGP at the paper's rules (Han et al., INFOCOM 2023, Sec. III; /work/shared/papers is
where the text lives): the `--paper` grid keeps a server side per client aggregated by
alpha_i = |D_i| / sum |D_k|, and the aggregation pinned on tensors small enough to do by hand."""

from __future__ import annotations

import torch
from torch.testing import assert_close

from broker.store import AUX_PART, CLIENT_PART, SERVER_PART, BlobRef
from services.algorithms.base import ClientUpdate, ShardReplica, average_replicas
from services.algorithms.splitgp import SplitGPSection, personalise
from services.experiments import splitgp
from services.experiments.runner import build_settings


def test_paper_grid_trains_a_theta_per_client_with_plain_sgd_and_gamma_half() -> None:
    paper = splitgp.build().at_paper()
    methods = set()
    for run in paper.runs:
        settings = build_settings(paper, run, quick=False)
        methods.add(run.tags["method"])
        assert settings.clients.fraction == 1.0  # every sum of Sec. III runs over k = 1..K
        assert settings.algorithm.momentum == 0.0  # eqs. (6)-(8): plain SGD steps
        if run.tags["method"] in (splitgp.SPLITGP, splitgp.MULTI_EXIT, splitgp.SFL):
            # "theta^{t+1} <- sum_i alpha_i theta_i^{t+1}": one theta_i per client; the SFL
            # baseline is SplitFed [26] (SplitGP at gamma = 0), so it keeps the same.
            assert settings.shards == settings.clients.count == 50
        if run.tags["method"] in (splitgp.SPLITGP, splitgp.MULTI_EXIT):
            section = settings.algorithm.section(SplitGPSection)
            assert section.gamma == 0.5  # "equal weights to both exits with gamma=0.5"
            assert section.lam == (0.0 if run.tags["method"] == splitgp.MULTI_EXIT else 0.2)
    assert methods == {
        splitgp.SPLITGP,
        splitgp.MULTI_EXIT,
        splitgp.SFL,
        splitgp.FEDAVG,
        splitgp.LOCAL,
    }


def test_theta_phi_and_h_are_weighted_by_dataset_size_and_phi_h_mixed_with_lambda() -> None:
    # Two clients with |D_a| = 1, |D_b| = 3: alpha = (1/4, 3/4).
    phi_a, phi_b = {"w": torch.tensor([0.0, 8.0])}, {"w": torch.tensor([4.0, 0.0])}
    h_a, h_b = {"h": torch.tensor([2.0])}, {"h": torch.tensor([6.0])}
    updates = [ClientUpdate("a", 1, 0, phi_a, h_a), ClientUpdate("b", 3, 0, phi_b, h_b)]
    previous = {
        BlobRef(CLIENT_PART): {"w": torch.zeros(2)},
        BlobRef(AUX_PART): {"h": torch.zeros(1)},
    }
    out = personalise(previous, updates, lam=0.2)
    # phi_bar = 1/4 [0, 8] + 3/4 [4, 0] = [3, 2];  h_bar = 1/4 * 2 + 3/4 * 6 = 5
    assert_close(out[BlobRef(CLIENT_PART)]["w"], torch.tensor([3.0, 2.0]))
    assert_close(out[BlobRef(AUX_PART)]["h"], torch.tensor([5.0]))
    # eq. (9): phi_k <- lam phi_k + (1 - lam) phi_bar
    # a: 0.2 [0, 8] + 0.8 [3, 2] = [2.4, 3.2];  b: 0.2 [4, 0] + 0.8 [3, 2] = [3.2, 1.6]
    assert_close(out[BlobRef(CLIENT_PART, "a")]["w"], torch.tensor([2.4, 3.2]))
    assert_close(out[BlobRef(CLIENT_PART, "b")]["w"], torch.tensor([3.2, 1.6]))
    # eq. (10), the same for h: a: 0.2 * 2 + 0.8 * 5 = 4.4;  b: 0.2 * 6 + 0.8 * 5 = 5.2
    assert_close(out[BlobRef(AUX_PART, "a")]["h"], torch.tensor([4.4]))
    assert_close(out[BlobRef(AUX_PART, "b")]["h"], torch.tensor([5.2]))
    # theta, one replica per client, each having trained on its whole D_i (one pass):
    # 1/4 [1, 3] + 3/4 [3, 7] = [2.5, 6]
    replicas = [
        ShardReplica(0, 1, {"t": torch.tensor([1.0, 3.0])}),
        ShardReplica(1, 3, {"t": torch.tensor([3.0, 7.0])}),
    ]
    theta = average_replicas(out, replicas)[BlobRef(SERVER_PART)]["t"]
    assert_close(theta, torch.tensor([2.5, 6.0]))
