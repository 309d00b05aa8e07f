"""The plugin's tests, run from its own repository: SplitMQ's strategy contract, and the rule."""

from __future__ import annotations

import torch
from median_sfl import MedianSFL

from services.algorithms.base import CLIENT, ClientUpdate
from services.testing import StrategyContract


class TestMedianSFL(StrategyContract):
    strategy = MedianSFL  # with its default parameters: three updates, so the median


def test_one_outlier_does_not_move_the_median() -> None:
    updates = [
        ClientUpdate(c, samples=10, base_version=1, client_weights={"w": torch.tensor([v])})
        for c, v in (("a", 1.0), ("b", 2.0), ("c", 1000.0))
    ]
    out = MedianSFL().aggregate({CLIENT: {"w": torch.tensor([0.0])}}, updates, [])
    assert out[CLIENT]["w"].item() == 2.0
