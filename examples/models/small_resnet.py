"""A small ResNet for 28x28 or 32x32 images, to split at a named module (examples/byo_model.toml).

Its forward is not its children applied in order (the residual additions, the pooling and the
flatten live in `forward`), so SplitMQ splits it with torch.fx at the modules the factory names:
`small_resnet` returns the model and the cuts `["stem", "layer1", "layer2"]`; a job picks one
with `model.cut`. Options come from `[model.options]` (`width`, `blocks`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class Residual(nn.Module):
    """conv-BN-ReLU-conv-BN plus the input (projected by a 1x1 conv when the shape changes)."""

    def __init__(self, in_channels: int, out_channels: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_channels)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_channels)
        self.project: nn.Module = nn.Identity()
        if stride != 1 or in_channels != out_channels:
            self.project = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, 1, stride, bias=False),
                nn.BatchNorm2d(out_channels),
            )

    def forward(self, x: Tensor) -> Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.project(x))


class SmallResNet(nn.Module):
    """A 3x3 stem, three stages of `blocks` residual blocks (`width` x 1, 2, 4 channels, stride
    2 from the second stage on), global average pooling and a linear classifier."""

    def __init__(self, in_channels: int, num_classes: int, width: int, blocks: int) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(in_channels, width, 3, padding=1, bias=False),
            nn.BatchNorm2d(width),
            nn.ReLU(),
        )
        self.layer1 = self._stage(width, width, blocks, stride=1)
        self.layer2 = self._stage(width, 2 * width, blocks, stride=2)
        self.layer3 = self._stage(2 * width, 4 * width, blocks, stride=2)
        self.fc = nn.Linear(4 * width, num_classes)

    @staticmethod
    def _stage(in_channels: int, out_channels: int, blocks: int, stride: int) -> nn.Sequential:
        layers = [Residual(in_channels, out_channels, stride)]
        layers += [Residual(out_channels, out_channels) for _ in range(blocks - 1)]
        return nn.Sequential(*layers)

    def forward(self, x: Tensor) -> Tensor:
        x = self.layer3(self.layer2(self.layer1(self.stem(x))))
        out: Tensor = self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))
        return out


def small_resnet(
    input_shape: tuple[int, ...], num_classes: int, width: int = 16, blocks: int = 1
) -> tuple[nn.Module, list[str]]:
    """The factory: SplitMQ passes `input_shape` and `num_classes`, `[model.options]` the rest."""
    if width < 1 or blocks < 1:
        raise ValueError(f"width and blocks must be >= 1, got {width} and {blocks}")
    model = SmallResNet(input_shape[0], num_classes, width, blocks)
    return model, ["stem", "layer1", "layer2"]
