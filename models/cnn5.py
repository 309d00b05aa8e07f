"""The classic "5-layer CNN" of the FedAvg / Sub-FedAvg MNIST experiments, with BatchNorm.

conv5x5(10)-BN-ReLU-pool2, conv5x5(20)-BN-ReLU-pool2, FC 50 + ReLU, FC num_classes.
For 28x28x1 input: about 21.9k parameters. Cuts: `block1`, `block2`, `block3` (after FC 50).
"""

from __future__ import annotations

from models.heads import HeadFactory, default_head
from models.layers import ConvBlock, FCBlock
from models.shapes import flat_features
from models.split import SplitNet


def cnn5(
    *,
    num_classes: int = 10,
    in_channels: int = 1,
    input_size: int = 28,
    head_factory: HeadFactory = default_head,
) -> SplitNet:
    input_shape = (in_channels, input_size, input_size)
    block1 = ConvBlock(in_channels, 10, 5, pool=2, bias=True)
    block2 = ConvBlock(10, 20, 5, pool=2, bias=True)
    features = flat_features([block1, block2], input_shape)
    return SplitNet(
        [
            ("block1", block1),
            ("block2", block2),
            ("block3", FCBlock(features, 50, flatten=True)),
            ("classifier", FCBlock(50, num_classes, act=False)),
        ],
        input_shape=input_shape,
        num_classes=num_classes,
        head_factory=head_factory,
    )
