"""`evaluate` and `Evaluator` on a hand-built two-layer net whose answers are known."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from broker.store import CLIENT_PART, SERVER_PART, BlobRef
from models.split import SplitNet
from services.aggregator.evaluation import Evaluator, evaluate
from services.algorithms.base import full_model_weights
from services.data.loaders import Split

# Identity layers: the logits are the inputs, so the prediction is the larger coordinate.
EYE = {"blocks.0.weight": torch.eye(2), "blocks.0.bias": torch.zeros(2)}
HEAD = {"blocks.1.weight": torch.eye(2), "blocks.1.bias": torch.zeros(2)}
# The same with the output swapped: predicts the smaller coordinate.
SWAP = {"blocks.1.weight": torch.tensor([[0.0, 1.0], [1.0, 0.0]]), "blocks.1.bias": torch.zeros(2)}

X = torch.tensor([[1.0, 0.0], [0.0, 1.0], [2.0, 1.0], [0.0, 3.0]])
Y = torch.tensor([0, 1, 1, 1])  # sample 2 is class 1 but its larger coordinate is 0


def tiny_net() -> SplitNet:
    return SplitNet(
        [("body", nn.Linear(2, 2)), ("out", nn.Linear(2, 2))], input_shape=(2,), num_classes=2
    )


def cross_entropy(logits: list[float], label: int) -> float:
    return -logits[label] + math.log(sum(math.exp(v) for v in logits))


def test_evaluate_counts_per_class_and_averages_the_loss() -> None:
    net = tiny_net()
    result = evaluate(net, {**EYE, **HEAD}, Split(X, Y), batch_size=3)  # two batches

    assert result.samples == 4
    assert result.accuracy == pytest.approx(3 / 4)
    assert (result.class_correct, result.class_total) == ((1, 2), (1, 3))
    expected = sum(cross_entropy(x.tolist(), int(y)) for x, y in zip(X, Y, strict=True)) / 4
    assert result.loss == pytest.approx(expected, rel=1e-6)
    assert result.accuracy_on([0]) == 1.0
    assert result.accuracy_on([1]) == pytest.approx(2 / 3)
    assert result.accuracy_on([]) == result.accuracy
    assert not net.training  # evaluation mode, left for the caller's scratch model


def test_evaluator_personal_accuracy_uses_each_clients_classes_and_own_weights() -> None:
    shared = {BlobRef(CLIENT_PART): EYE, BlobRef(SERVER_PART): HEAD}
    evaluator = Evaluator(tiny_net(), Split(X, Y))

    result = evaluator.evaluate(shared, {"a": [0], "b": [1]})
    assert result.global_accuracy == pytest.approx(3 / 4)
    assert result.personal_accuracy == pytest.approx((1.0 + 2 / 3) / 2)

    # Client "b" has its own server part (a personalised algorithm): the swapped head gets
    # class-1 sample 2 right and samples 1 and 3 wrong, so 1/3 on b's local test set.
    personal = {**shared, BlobRef(SERVER_PART, "b"): SWAP}
    result = evaluator.evaluate(personal, {"a": [0], "b": [1]})
    assert result.global_accuracy == pytest.approx(3 / 4)
    assert result.personal_accuracy == pytest.approx((1.0 + 1 / 3) / 2)


def test_evaluator_caps_the_test_set() -> None:
    evaluator = Evaluator(tiny_net(), Split(X, Y), max_samples=2)
    result = evaluator.evaluate({BlobRef(CLIENT_PART): {**EYE, **HEAD}}, {})
    assert result.test_samples == 2
    assert result.global_accuracy == 1.0
    assert math.isnan(result.personal_accuracy)


def test_full_model_weights_layers_personal_over_global() -> None:
    blobs = {
        BlobRef(CLIENT_PART): EYE,
        BlobRef(SERVER_PART): HEAD,
        BlobRef(SERVER_PART, "b"): SWAP,
    }
    assert full_model_weights(blobs)["blocks.1.weight"] is HEAD["blocks.1.weight"]
    assert full_model_weights(blobs, "b")["blocks.1.weight"] is SWAP["blocks.1.weight"]
    assert full_model_weights(blobs, "a")["blocks.1.weight"] is HEAD["blocks.1.weight"]
