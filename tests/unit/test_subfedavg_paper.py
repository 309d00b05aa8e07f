"""Sub-FedAvg at the paper's setting (Vahidian et al., ICDCSW 2021; the text is in
/work/shared/papers/subfedavg.txt): the `--paper` grid's settings, the two architectures as the
text describes them, and a client's local test set, each against the paper's words."""

from __future__ import annotations

import numpy as np
import pytest
from torch import nn

from models.registry import build_model
from services.algorithms.subfedavg import SubFedAvgSection
from services.data.partition import local_test_indices
from services.experiments import subfedavg
from services.experiments.runner import build_settings


def test_paper_grid_is_the_texts_setting() -> None:
    paper = subfedavg.build().at_paper()
    seen: set[tuple[str, str]] = set()
    for run in paper.runs:
        s = build_settings(paper, run, quick=False)
        seen.add((run.tags["dataset"], run.tags["method"]))
        # "we setup 100 clients with local batch size 10, local epoch 5, and an SGD optimizer
        # with learning rate and momentum of 0.01 and 0.5"
        assert s.clients.count == 100
        assert (s.algorithm.batch_size, s.algorithm.local_epochs) == (10, 5)
        assert s.algorithm.max_steps_per_round == 0  # five whole passes, no cap
        assert (s.algorithm.lr, s.algorithm.momentum) == (0.01, 0.5)
        # "shards of 250 examples ... randomly assign two shards to each client"
        assert (s.data.partition, s.data.shard_size, s.data.shards_per_client) == (
            "shards",
            250,
            2,
        )
        assert s.data.distinct_shards is False
        # "Evaluation data for each client is all the test set for the ... labels they have"
        assert s.data.eval_samples == 0
        model = {"CIFAR-10": ("cifar10", "lenet5"), "MNIST": ("mnist", "cnn5")}
        assert (s.data.dataset, s.model.name) == model[run.tags["dataset"]]
        if s.algorithm.name == "subfedavg":
            section = s.algorithm.section(SubFedAvgSection)
            assert section.scope == "full"  # FL on the whole model, as in the paper
            # "the threshold for distance of masks are 10^-4, and 0.05 for unstructured and,
            # hybrid pruning algorithms, respectively"
            assert section.dist_thresh == 0.0001
            assert section.channel_dist_thresh == 0.05
    # "For unstructured pruning ... 30%, 50%, and 70% ... for the hybrid pruning ... 50%, 70%,
    # and 90%"; Standalone and FedAvg beside them.
    methods = {
        *(f"Sub-FedAvg (Un) {p}%" for p in (30, 50, 70)),
        *(f"Sub-FedAvg (Hy) {p}%" for p in (50, 70, 90)),
        subfedavg.STANDALONE,
        subfedavg.FEDAVG,
    }
    assert seen == {(d, m) for d in ("CIFAR-10", "MNIST") for m in methods}
    targets = {
        run.tags["method"]: build_settings(paper, run, quick=False)
        .algorithm.section(SubFedAvgSection)
        .target
        for run in paper.runs
        if run.tags["method"] in subfedavg.SUB_METHODS
    }
    assert targets["Sub-FedAvg (Hy) 90%"] == 0.9


def layers(model: nn.Module) -> list[str]:
    """The model's layers in order, as the paper names them."""
    out = []
    for m in model.modules():
        if isinstance(m, nn.Conv2d):
            out.append(f"conv{m.kernel_size[0]}x{m.kernel_size[1]}:{m.out_channels}")
        elif isinstance(m, nn.BatchNorm2d):
            out.append("bn")
        elif isinstance(m, nn.MaxPool2d):
            out.append("pool2")
        elif isinstance(m, nn.Linear):
            out.append(f"fc:{m.out_features}")
    return out


def params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def test_the_mnist_cnn_is_the_papers_and_its_parameter_count_is_that_of_32x32_inputs() -> None:
    # "two layers of 5x5 convolutional layer with 10 and 20 channels respectively, and each
    # convolutional layer is followed by batch-normalization and 2x2 max pooling layers ... a
    # fully-connected layer with 50 units followed by another ... with 10 units"
    model = build_model("cnn5", heads=False)
    convs = ["conv5x5:10", "bn", "pool2", "conv5x5:20", "bn", "pool2"]
    assert layers(model) == [*convs, "fc:50", "fc:10"]
    # MNIST at 28x28: 1*10*25+10 + 10 + 10 (BN) + 10*20*25+20 + 20 + 20 + 320*50+50 + 50*10+10
    assert params(model) == 21_900
    # "(30900 total parameters + 30 channels)": the same layers on 32x32 inputs, where the first
    # Linear reads 20*5*5 = 500 features: 21,900 + 180 * 50 = 30,900.
    assert params(build_model("cnn5", heads=False, input_size=32)) == 30_900
    channels = sum(m.num_features for m in model.modules() if isinstance(m, nn.BatchNorm2d))
    assert channels == 30


def test_lenet5_has_batchnorm_after_each_conv_and_the_papers_size() -> None:
    # "LeNet-5 (62000 total parameters ...) ... we also add a batch-normalization layer after
    # each convolutional layer"
    model = build_model("lenet5", heads=False)
    names = layers(model)
    assert [n for n in names if n != "pool2"] == [
        "conv5x5:6",
        "bn",
        "conv5x5:16",
        "bn",
        "fc:120",
        "fc:84",
        "fc:10",
    ]
    # 3*6*25+6 + 12 + 6*16*25+16 + 32 + 400*120+120 + 120*84+84 + 84*10+10
    assert params(model) == 62_050
    assert params(model) == pytest.approx(62_000, rel=0.001)


def test_a_clients_local_test_set_is_every_test_row_of_its_labels() -> None:
    # Two shards of label 3 (a random deal may give that): its local test set is label 3 only.
    test_labels = np.array([0, 3, 7, 3, 9, 7, 3])
    assert local_test_indices(test_labels, np.array([3, 3, 3, 3])).tolist() == [1, 3, 6]
    assert local_test_indices(test_labels, np.array([7, 3, 7])).tolist() == [1, 2, 3, 5, 6]
