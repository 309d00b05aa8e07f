"""A small VGG-style CNN for 28x28 or 32x32 input.

Stages of 3x3 conv-BN-ReLU layers, each stage ending in a 2x2 max-pool (default
[32, 32, pool, 64, 64, pool, 128, pool]), then flatten - FC `hidden` + ReLU - FC num_classes.
Cuts: `stage1`.. `stage<n>` and `fc1`.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from models.errors import ModelSpecError
from models.heads import HeadFactory, default_head
from models.layers import ConvStage, FCBlock
from models.shapes import flat_features
from models.split import SplitNet

DEFAULT_STAGES = ((32, 32), (64, 64), (128,))


def vgg_small(
    *,
    num_classes: int = 10,
    in_channels: int = 3,
    input_size: int = 32,
    stages: Sequence[Sequence[int]] = DEFAULT_STAGES,
    hidden: int = 256,
    head_factory: HeadFactory = default_head,
) -> SplitNet:
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
