"""A small model factory for feature-vector datasets ([N, F]), named by the tests' configs as
`model.name = "tests.integration.tabular_model:mlp"`: built-in CNNs take images only."""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn


def mlp(
    input_shape: Sequence[int], num_classes: int, hidden: int = 32
) -> list[tuple[str, nn.Module]]:
    """Three blocks, each boundary a cut: block1 | block2 | classifier."""
    (features,) = input_shape
    return [
        ("block1", nn.Sequential(nn.Linear(features, hidden), nn.ReLU())),
        ("block2", nn.Sequential(nn.Linear(hidden, hidden), nn.ReLU())),
        ("classifier", nn.Linear(hidden, num_classes)),
    ]
