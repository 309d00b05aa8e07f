"""FedSplitX against its paper's text (/work/shared/papers/fedsplitx.txt): the paper setting
and the grid run on it (`splitmq experiment fedsplitx --paper`)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from broker.store import AUX_PART, CLIENT_PART, SERVER_PART, BlobRef
from models.zoo import cnn5
from services.algorithms.fedsplitx import FedSplitX
from services.algorithms.registry import build_strategy
from services.config.loading import load_settings
from services.experiments import fedsplitx
from services.experiments.results import RunResult, SeedRuns
from services.experiments.spec import EXAMPLES_DIR
from tests.unit.test_fedsplitx import two_level_round

PAPER_TOML = EXAMPLES_DIR / "fedsplitx-paper.toml"


def test_paper_setting_is_the_papers_text() -> None:
    s = load_settings(str(PAPER_TOML))
    # "We utilized ResNet18 ..."; "CFIAR-10 ... independent and identically distributed".
    assert (s.model.name, s.data.dataset, s.data.partition) == ("resnet18", "cifar10", "iid")
    # "random cropping, random horizontal flip, and normalization".
    assert s.data.augment.crop_padding == 4 and s.data.augment.horizontal_flip
    # "16, 16, 18 clients at depth level 1, level 2 and level 3": 50 clients.
    assert (s.clients.count, s.clients.capability_mix) == (50, "16,16,18")
    # "three depth levels d_k = 1, 2, 3": three partition points of ResNet-18.
    assert s.algorithm.params()["cuts"] == "layer1,layer2,layer3"
    # "aggregates the client-side model and server-side model separately".
    assert s.algorithm.params()["aggregation"] == "separate"


def test_the_setting_reaches_the_strategy() -> None:
    strategy = build_strategy("fedsplitx", {"aggregation": "separate"})
    assert isinstance(strategy, FedSplitX) and strategy.aggregation == "separate"
    assert FedSplitX().aggregation == "merged"  # the scaled experiment's reading, kept


def test_client_side_and_server_side_are_aggregated_separately() -> None:
    # Paper, section 2: "FedSplitX aggregates the client-side model and server-side model
    # separately. The aggregation of server-side model parameters is performed at the main
    # server, while the aggregation of client-side model parameters takes place at the fed
    # server." cnn5, levels block1/2/3 (blocks 0/1/2, output block 3).
    # Client a at level 1 (10 rows, +1), b at level 2 (30 rows, +4), the replica +8.
    previous, out = two_level_round(FedSplitX(aggregation="separate"))

    def moved(part: str, name: str) -> float:
        ref = BlobRef(part)
        return float((out[ref][name] - previous[ref][name]).flatten()[0])

    # w^c: block1 and a_1 from both clients, (10 * 1 + 30 * 4) / 40 = 3.25.
    assert moved(CLIENT_PART, "blocks.0.conv.weight") == pytest.approx(3.25)
    assert moved(AUX_PART, "heads.block1.fc.weight") == pytest.approx(3.25)
    # block2 and a_2 on the client side: client b alone, 4 (merged with the replica it was
    # (30 * 4 + 10 * 8) / 40 = 5).
    assert moved(CLIENT_PART, "blocks.1.conv.weight") == pytest.approx(4.0)
    assert moved(AUX_PART, "heads.block2.fc.weight") == pytest.approx(4.0)
    # block3 and a_3 on the client side: no level-3 client this round, unchanged.
    assert moved(CLIENT_PART, "blocks.2.fc.weight") == 0.0
    assert moved(AUX_PART, "heads.block3.fc.weight") == 0.0
    # w^s: the replica alone, +8 wherever a batch reached (block2 by a's rows, the rest by all).
    for name in ("blocks.1.conv.weight", "heads.block2.fc.weight", "blocks.2.fc.weight"):
        assert moved(SERVER_PART, name) == pytest.approx(8.0)
    assert moved(SERVER_PART, "blocks.3.fc.weight") == pytest.approx(8.0)


def test_paper_grid_runs_the_baselines_at_the_resnet_cuts() -> None:
    paper = fedsplitx.build().at_paper()
    runs = {r.label: r.overrides for r in paper.runs}
    assert set(runs) == {
        "fedsplitx",
        "exc-level1-local_loss_sfl-layer1",
        "exc-level2",
        "exc-level3",
        "all-level3",
    }
    assert runs["fedsplitx"]["clients"]["capability_mix"] == "16,16,18"
    # EXC-level-1 (= AccSFL at the front cut): all 50 clients at layer1.
    assert runs["exc-level1-local_loss_sfl-layer1"]["model"]["cut"] == "layer1"
    assert runs["exc-level1-local_loss_sfl-layer1"]["clients"]["count"] == 50
    # "EXC ... depth level 3, only 18 clients participate in the training".
    assert runs["exc-level3"]["model"]["cut"] == "layer3"
    assert runs["exc-level3"]["clients"]["count"] == 18
    # ... and the other 32 clients' images are left out: 50,000 * 18 / 50 = 18,000 rows, the
    # 1,000 per client of the paper's IID split over 50.
    assert runs["exc-level3"]["data"]["train_samples"] == 18_000
    assert "data" not in runs["all-level3"]
    # "level 1, level 2, and level 3": EXC-level-2 is the 16 + 18 = 34 capable clients with
    # 50,000 * 34 / 50 = 34,000 rows.
    assert runs["exc-level2"]["model"]["cut"] == "layer2"
    assert runs["exc-level2"]["clients"]["count"] == 34
    assert runs["exc-level2"]["data"]["train_samples"] == 34_000
    # The scaled grid stays as it was: no EXC-level-2, EXC-level-3 on the whole split.
    scaled = {r.label: r.overrides for r in fedsplitx.build().runs}
    assert "exc-level2" not in scaled and "data" not in scaled["exc-level3"]
    assert runs["all-level3"]["clients"]["count"] == 50


def _result(name: str, final: dict[str, float]) -> SeedRuns:
    run = next(r for r in fedsplitx.build().at_paper().runs if r.label == name)
    return SeedRuns((RunResult(run, Path("."), "finished", 1.0, 1, (), final=final),))


def test_a_level_model_is_read_at_the_runs_own_cut() -> None:
    # FedSplitX's final_eval writes one key per level, shallow to deep; level 2 is the second.
    fed = _result(
        "fedsplitx",
        {
            "full_accuracy": 0.9,
            "client_accuracy.layer1": 0.5,
            "client_accuracy.layer2": 0.6,
            "client_accuracy.layer3": 0.7,
        },
    )
    assert fedsplitx.accuracy(fed, 2) == 0.6
    assert fedsplitx.accuracy(fed, None) == 0.9
    # EXC-level-3 trains only the level-3 model (ending at layer3), none at level 1.
    exc3 = _result("exc-level3", {"full_accuracy": 0.8, "client_accuracy.layer3": 0.65})
    assert fedsplitx.accuracy(exc3, 3) == 0.65
    assert math.isnan(fedsplitx.accuracy(exc3, 1))


def test_the_full_model_of_level_m_is_the_client_side_to_c_m_then_the_server_side() -> None:
    # Paper: w^c_m = w^c[:m], w^s_m = w^s[m:], and Table 1 reports a full model per level.
    model = cnn5()
    strategy = FedSplitX(aggregation="separate").for_model(lambda: model, "block1")
    blobs = strategy.initial_weights(model, "block1")
    server = dict(blobs[BlobRef(SERVER_PART)])
    # The server's output layer says class 1 whatever it is fed: weights 0, bias e_1.
    server["blocks.3.fc.weight"] = torch.zeros_like(server["blocks.3.fc.weight"])
    bias = torch.zeros_like(server["blocks.3.fc.bias"])
    bias[1] = 100.0
    server["blocks.3.fc.bias"] = bias
    blobs[BlobRef(SERVER_PART)] = server
    # The clients' copy of block2 is NaN: any model that runs it outputs NaN (argmax 0).
    client = dict(blobs[BlobRef(CLIENT_PART)])
    client["blocks.1.conv.weight"] = torch.full_like(client["blocks.1.conv.weight"], math.nan)
    blobs[BlobRef(CLIENT_PART)] = client
    x, y = torch.randn(8, 1, 28, 28), torch.ones(8, dtype=torch.long)
    out = strategy.personal_metrics(model, blobs, x, y, {})
    # Level 1: client block1, then the server's block2, block3 and output: all class 1.
    assert out["level1.full_accuracy"] == 1.0
    # Levels 2 and 3 run the clients' block2: NaN logits, argmax 0, none right.
    assert out["level2.full_accuracy"] == 0.0
    assert out["level3.full_accuracy"] == 0.0


def test_the_paper_grids_exc_level3_full_model_is_accsfl_at_level3() -> None:
    # "Comparing the performance of the client-side and full models between AccSFL and
    # FedSplitX at depth-level 3": the 18-client run at layer3 is AccSFL there, full model too.
    exc3 = _result("exc-level3", {"full_accuracy": 0.8, "client_accuracy.layer3": 0.65})
    assert fedsplitx.has_full_model(exc3)
    assert fedsplitx.model_rows(exc3) == [(3, 0.65), (None, 0.8)]
    scaled = next(r for r in fedsplitx.build().runs if r.label == "exc-level3")
    assert fedsplitx.ALSO not in scaled.tags  # cnn5's server side after block3 is one layer
