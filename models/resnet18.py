"""ResNet-18, CIFAR variant: a 3x3 stem conv (no max-pool), four stages of two BasicBlocks
(64, 128, 256, 512 channels; stride 2 from the second stage on), global average pool, FC.

About 11.17M parameters at width 64 with 10 classes. Cuts: `stem`, `layer1`..`layer4`.
`width` scales every stage (e.g. 16 for a quick CPU run).
"""

from __future__ import annotations

from torch import Tensor, nn

from models.heads import HeadFactory, default_head
from models.layers import ConvBlock
from models.split import SplitNet


class BasicBlock(nn.Module):
    """Two 3x3 conv-BN layers with a residual connection; a 1x1 conv-BN projection when the
    shape changes."""

    def __init__(self, in_channels: int, out_channels: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_channels)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, 1, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_channels)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or in_channels != out_channels:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, 1, stride, bias=False),
                nn.BatchNorm2d(out_channels),
            )
        self.act = nn.ReLU(inplace=True)

    def forward(self, x: Tensor) -> Tensor:
        out = self.act(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        result: Tensor = self.act(out + self.shortcut(x))
        return result


class PoolClassifier(nn.Module):
    """Global average pool, flatten, linear."""

    def __init__(self, in_channels: int, num_classes: int) -> None:
        super().__init__()
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.flatten = nn.Flatten()
        self.fc = nn.Linear(in_channels, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.fc(self.flatten(self.pool(x)))
        return out


def _stage(in_channels: int, out_channels: int, stride: int) -> nn.Sequential:
    return nn.Sequential(
        BasicBlock(in_channels, out_channels, stride), BasicBlock(out_channels, out_channels)
    )


def resnet18(
    *,
    num_classes: int = 10,
    in_channels: int = 3,
    input_size: int = 32,
    width: int = 64,
    head_factory: HeadFactory = default_head,
) -> SplitNet:
    w = width
    return SplitNet(
        [
            ("stem", ConvBlock(in_channels, w, 3, padding=1)),
            ("layer1", _stage(w, w, 1)),
            ("layer2", _stage(w, 2 * w, 2)),
            ("layer3", _stage(2 * w, 4 * w, 2)),
            ("layer4", _stage(4 * w, 8 * w, 2)),
            ("classifier", PoolClassifier(8 * w, num_classes)),
        ],
        input_shape=(in_channels, input_size, input_size),
        num_classes=num_classes,
        head_factory=head_factory,
    )
