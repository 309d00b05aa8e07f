"""What the strategy contract runs a strategy against: a tiny synthetic model, its batches, and a
channel standing in for the worker. No data set, no broker, a fraction of a second on a CPU."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from models.heads import default_head
from models.split import SplitNet
from models.zoo import ConvBlock, FCBlock

INPUT_SHAPE = (1, 8, 8)
CLASSES = 4
ROWS = 8  # per batch
CUT = "block1"


def tiny_model(*, heads: bool = True, seed: int = 0) -> SplitNet:
    """Two conv-BN blocks and two linear ones over 1x8x8 inputs, 4 classes (cuts `block1`,
    `block2`, `block3`): the built-in models' kinds of layer, BatchNorm buffers included, at
    a few hundred parameters. Seeded without touching the caller's random state."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        blocks = [
            ("block1", ConvBlock(1, 4, 3, padding=1, pool=2, bias=True)),  # 4x4x4
            ("block2", ConvBlock(4, 8, 3, padding=1, pool=2, bias=True)),  # 8x2x2
            ("block3", FCBlock(32, 16, flatten=True)),
            ("classifier", FCBlock(16, CLASSES, act=False)),
        ]
        factory = default_head if heads else None
        return SplitNet(blocks, input_shape=INPUT_SHAPE, num_classes=CLASSES, head_factory=factory)


def batches(steps: int, *, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`steps` batches of `ROWS` random inputs and labels for `tiny_model`."""
    g = torch.Generator().manual_seed(seed)
    return [
        (
            torch.randn(ROWS, *INPUT_SHAPE, generator=g),
            torch.randint(0, CLASSES, (ROWS,), generator=g),
        )
        for _ in range(steps)
    ]


class FakeTally:
    def metrics(self) -> Mapping[str, float]:
        return {"train_accuracy": 1.0}


class FakeChannel:
    """A worker that answers every batch with a small gradient of the activation's shape, and
    records what the client sent through which call."""

    def __init__(self) -> None:
        self.tally = FakeTally()
        self.exchanged: list[tuple[int, ...]] = []
        self.sent: list[tuple[int, ...]] = []

    def exchange(self, z: torch.Tensor, y: torch.Tensor, step: int, steps: int) -> torch.Tensor:
        self.exchanged.append(tuple(z.shape))
        return torch.full_like(z, 1e-3)

    def send(self, z: torch.Tensor, y: torch.Tensor, step: int, steps: int) -> None:
        self.sent.append(tuple(z.shape))

    def forward(self, z: torch.Tensor, step: int, steps: int) -> torch.Tensor:
        raise AssertionError("a U-shaped call in a round whose model has no tail")

    def backward(self, grad: torch.Tensor) -> torch.Tensor:
        raise AssertionError("a U-shaped call in a round whose model has no tail")
