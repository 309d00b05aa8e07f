"""LeNet-5 with BatchNorm, for 32x32 colour images (CIFAR-10).

conv5x5(6)-BN-ReLU-pool2, conv5x5(16)-BN-ReLU-pool2, FC 120, FC 84 (ReLU each), FC num_classes.
Cuts: `block1`..`block4` (after each layer but the classifier).
"""

from __future__ import annotations

from models.heads import HeadFactory, default_head
from models.layers import ConvBlock, FCBlock
from models.shapes import flat_features
from models.split import SplitNet


def lenet5(
    *,
    num_classes: int = 10,
    in_channels: int = 3,
    input_size: int = 32,
    head_factory: HeadFactory = default_head,
) -> SplitNet:
    input_shape = (in_channels, input_size, input_size)
    block1 = ConvBlock(in_channels, 6, 5, pool=2, bias=True)
    block2 = ConvBlock(6, 16, 5, pool=2, bias=True)
    features = flat_features([block1, block2], input_shape)
    return SplitNet(
        [
            ("block1", block1),
            ("block2", block2),
            ("block3", FCBlock(features, 120, flatten=True)),
            ("block4", FCBlock(120, 84)),
            ("classifier", FCBlock(84, num_classes, act=False)),
        ],
        input_shape=input_shape,
        num_classes=num_classes,
        head_factory=head_factory,
    )
