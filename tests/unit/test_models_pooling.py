"""models.pooling.MaxPool2d: without autograd its slice path gives exactly `nn.MaxPool2d`'s
values; with autograd it is `nn.MaxPool2d` (values and gradients, ties included)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from models.pooling import MaxPool2d, max_pool_2x2
from models.registry import build_model


def same(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("shape", [(4, 3, 28, 28), (2, 5, 7, 9), (3, 11, 10), (1, 1, 2, 2)])
def test_without_autograd_the_values_are_torchs(shape: tuple[int, ...]) -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=g)
    x.view(-1)[::17] = float("nan")
    x.view(-1)[5::23] = float("-inf")
    x.view(-1)[7::29] = 0.0  # ties
    same(max_pool_2x2(x), nn.MaxPool2d(2)(x))
    with torch.no_grad():
        same(MaxPool2d(2)(x), nn.MaxPool2d(2)(x))
    same(MaxPool2d(2)(x), nn.MaxPool2d(2)(x))  # no input that needs a gradient: slices too


@pytest.mark.parametrize(
    "options",
    [
        {"kernel_size": 3},
        {"kernel_size": 2, "stride": 1},
        {"kernel_size": 2, "padding": 1},
        {"kernel_size": 2, "ceil_mode": True},
    ],
)
def test_other_windows_are_torchs_own(options: dict[str, object]) -> None:
    x = torch.randn(2, 3, 9, 9)
    with torch.no_grad():
        same(MaxPool2d(**options)(x), nn.MaxPool2d(**options)(x))  # type: ignore[arg-type]


def test_with_autograd_values_and_gradients_are_torchs_ties_included() -> None:
    for x in (torch.randn(3, 4, 12, 12), torch.ones(3, 4, 12, 12)):  # ones: every window ties
        ours, theirs = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
        out, ref = MaxPool2d(2)(ours), nn.MaxPool2d(2)(theirs)
        same(out, ref)
        weights = torch.randn(out.shape)
        (out * weights).sum().backward()
        (ref * weights).sum().backward()
        assert ours.grad is not None and theirs.grad is not None
        same(ours.grad, theirs.grad)


def test_the_zoo_models_evaluate_exactly_as_with_torchs_pooling() -> None:
    torch.manual_seed(0)
    model = build_model("cnn5").eval()
    reference = copy.deepcopy(model)
    swapped = 0
    for parent in reference.modules():
        for name, child in parent.named_children():
            if isinstance(child, MaxPool2d):
                setattr(parent, name, nn.MaxPool2d(2))
                swapped += 1
    assert swapped == 2
    x = torch.randn(64, 1, 28, 28)
    with torch.no_grad():
        same(model(x), reference(x))
