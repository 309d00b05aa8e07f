"""The built-in models and their building blocks. Attribute names fix the state-dict names
(`conv`, `bn`, `fc`...), so keep them stable: stored weights are addressed by them.

Every builder takes keyword-only `num_classes`, `in_channels`, `input_size` (square inputs) and
`head_factory` (`models.heads`), and returns a `SplitNet` whose cuts are named after the block
they follow (every block but the classifier).
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial

from torch import Tensor, nn

from models.errors import ModelSpecError
from models.heads import AuxHead, HeadFactory, default_head
from models.pooling import MaxPool2d
from models.split import SplitNet, flat_features


class ConvBlock(nn.Module):
    """conv - BatchNorm - ReLU - optional max-pool.

    `bias` defaults to False because BN's shift makes a conv bias redundant; the classic small
    CNNs (CNN5, LeNet-5) keep it so their parameter counts match the papers'.
    """

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: int,
        *,
        padding: int = 0,
        pool: int | None = None,
        bias: bool = False,
    ) -> None:
        super().__init__()
        self.conv = nn.Conv2d(in_channels, out_channels, kernel_size, padding=padding, bias=bias)
        self.bn = nn.BatchNorm2d(out_channels)
        self.act = nn.ReLU(inplace=True)
        self.pool: nn.Module = MaxPool2d(pool) if pool else nn.Identity()

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.pool(self.act(self.bn(self.conv(x))))
        return out


class ConvStage(nn.Module):
    """Several 3x3 ConvBlocks (padding 1) followed by one 2x2 max-pool (VGG style)."""

    def __init__(self, in_channels: int, widths: tuple[int, ...]) -> None:
        super().__init__()
        channels = (in_channels, *widths)
        self.convs = nn.Sequential(
            *(ConvBlock(channels[i], channels[i + 1], 3, padding=1) for i in range(len(widths)))
        )
        self.pool = MaxPool2d(2)

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.pool(self.convs(x))
        return out


class FCBlock(nn.Module):
    """Optional flatten - linear - optional ReLU."""

    def __init__(
        self, in_features: int, out_features: int, *, flatten: bool = False, act: bool = True
    ) -> None:
        super().__init__()
        self.flatten: nn.Module = nn.Flatten() if flatten else nn.Identity()
        self.fc = nn.Linear(in_features, out_features)
        self.act: nn.Module = nn.ReLU(inplace=True) if act else nn.Identity()

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.act(self.fc(self.flatten(x)))
        return out


def _classic(
    convs: tuple[int, int],
    hidden: tuple[int, ...],
    *,
    num_classes: int = 10,
    in_channels: int,
    input_size: int,
    head_factory: HeadFactory | None = default_head,
) -> SplitNet:
    """Two conv5x5-BN-ReLU-pool2 blocks (with conv biases), FC layers of `hidden` (ReLU each),
    FC num_classes; blocks `block1`, `block2`, ... and `classifier`."""
    input_shape = (in_channels, input_size, input_size)
    block1 = ConvBlock(in_channels, convs[0], 5, pool=2, bias=True)
    block2 = ConvBlock(convs[0], convs[1], 5, pool=2, bias=True)
    widths = (flat_features([block1, block2], input_shape), *hidden)
    fcs = [
        (f"block{i + 3}", FCBlock(widths[i], widths[i + 1], flatten=i == 0))
        for i in range(len(hidden))
    ]
    return SplitNet(
        [
            ("block1", block1),
            ("block2", block2),
            *fcs,
            ("classifier", FCBlock(widths[-1], num_classes, act=False)),
        ],
        input_shape=input_shape,
        num_classes=num_classes,
        head_factory=head_factory,
    )


# The classic "5-layer CNN" of the FedAvg / Sub-FedAvg MNIST experiments, with BatchNorm:
# conv5x5(10), conv5x5(20), FC 50, FC num_classes. For 28x28x1 input: about 21.9k parameters.
# Cuts: `block1`, `block2`, `block3` (after FC 50).
cnn5 = partial(_classic, (10, 20), (50,), in_channels=1, input_size=28)
# LeNet-5 with BatchNorm, for 32x32 colour images (CIFAR-10): conv5x5(6), conv5x5(16), FC 120,
# FC 84, FC num_classes. Cuts: `block1`..`block4`.
lenet5 = partial(_classic, (6, 16), (120, 84), in_channels=3, input_size=32)


def vgg_small(
    *,
    num_classes: int = 10,
    in_channels: int = 3,
    input_size: int = 32,
    stages: Sequence[Sequence[int]] = ((32, 32), (64, 64), (128,)),
    hidden: int = 256,
    head_factory: HeadFactory | None = default_head,
) -> SplitNet:
    """A small VGG-style CNN for 28x28 or 32x32 input: `ConvStage`s of `stages` widths, then
    flatten - FC `hidden` + ReLU - FC num_classes. Cuts: `stage1`.. `stage<n>` and `fc1`."""
    if not stages or not all(stages):
        raise ModelSpecError(f"vgg_small needs non-empty stages, got {stages!r}")
    input_shape = (in_channels, input_size, input_size)
    blocks: list[tuple[str, nn.Module]] = []
    channels = in_channels
    for i, widths in enumerate(stages, start=1):
        blocks.append((f"stage{i}", ConvStage(channels, tuple(widths))))
        channels = widths[-1]
    features = flat_features([block for _, block in blocks], input_shape)
    blocks.append(("fc1", FCBlock(features, hidden, flatten=True)))
    blocks.append(("classifier", FCBlock(hidden, num_classes, act=False)))
    return SplitNet(
        blocks, input_shape=input_shape, num_classes=num_classes, head_factory=head_factory
    )


def vgg_mini(
    *,
    num_classes: int = 10,
    in_channels: int = 1,
    input_size: int = 28,
    head_factory: HeadFactory | None = default_head,
) -> SplitNet:
    """A five-conv `vgg_small` for 28x28 grayscale input, small enough for 50-client runs on a
    CPU: stages [8, pool, 16, pool, 32, 32, pool, 64, pool], FC 64 + ReLU, FC num_classes.

    SplitGP's MNIST/Fashion-MNIST setup puts four conv layers and a linear head on the client:
    the cut `stage3` leaves exactly those (activation 32x3x3 for 28x28 input; its auxiliary
    head is one linear layer on the 2x2-pooled map) and one conv layer plus the two FC layers
    on the server. About 1.1M multiply-adds per 28x28 image, a fifth of `vgg_small`'s. Cuts:
    `stage1`..`stage4` and `fc1`.
    """
    return vgg_small(
        num_classes=num_classes,
        in_channels=in_channels,
        input_size=input_size,
        stages=((8,), (16,), (32, 32), (64,)),
        hidden=64,
        head_factory=head_factory,
    )


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


def resnet18(
    *,
    num_classes: int = 10,
    in_channels: int = 3,
    input_size: int = 32,
    width: int = 64,
    head_factory: HeadFactory | None = default_head,
) -> SplitNet:
    """ResNet-18, CIFAR variant: a 3x3 stem conv (no max-pool), four stages of two BasicBlocks
    (`width` x 1, 2, 4, 8 channels; stride 2 from the second stage on), global average pool, FC.

    About 11.17M parameters at width 64 with 10 classes (16 makes a quick CPU run). Cuts:
    `stem`, `layer1`..`layer4`.
    """
    w = width

    def stage(in_channels: int, out_channels: int, stride: int) -> nn.Sequential:
        return nn.Sequential(
            BasicBlock(in_channels, out_channels, stride), BasicBlock(out_channels, out_channels)
        )

    return SplitNet(
        [
            ("stem", ConvBlock(in_channels, w, 3, padding=1)),
            ("layer1", stage(w, w, 1)),
            ("layer2", stage(w, 2 * w, 2)),
            ("layer3", stage(2 * w, 4 * w, 2)),
            ("layer4", stage(4 * w, 8 * w, 2)),
            # Global average pool, flatten, linear: a head pooled to 1x1 (only C matters).
            ("classifier", AuxHead((8 * w, 1, 1), num_classes, pool=1)),
        ],
        input_shape=(in_channels, input_size, input_size),
        num_classes=num_classes,
        head_factory=head_factory,
    )
