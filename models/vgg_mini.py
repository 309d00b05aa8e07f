"""A five-conv VGG-style CNN for 28x28 grayscale input, small enough for 50-client runs on a CPU.

SplitGP's MNIST/Fashion-MNIST setup puts four conv layers and a linear head on the client;
this is `vgg_small` with stages [8, pool, 16, pool, 32, 32, pool, 64, pool], FC 64 + ReLU,
FC num_classes, so the cut `stage3` leaves exactly four conv layers on the client (activation
32x3x3 for 28x28 input; its auxiliary head is one linear layer on the 2x2-pooled map) and one
conv layer plus the two FC layers on the server. About 1.1M multiply-adds per 28x28 image,
a fifth of `vgg_small`'s. Cuts: `stage1`..`stage4` and `fc1`.
"""

from __future__ import annotations

from models.heads import HeadFactory, default_head
from models.split import SplitNet
from models.vgg_small import vgg_small

MINI_STAGES = ((8,), (16,), (32, 32), (64,))
MINI_HIDDEN = 64


def vgg_mini(
    *,
    num_classes: int = 10,
    in_channels: int = 1,
    input_size: int = 28,
    head_factory: HeadFactory = default_head,
) -> SplitNet:
    return vgg_small(
        num_classes=num_classes,
        in_channels=in_channels,
        input_size=input_size,
        stages=MINI_STAGES,
        hidden=MINI_HIDDEN,
        head_factory=head_factory,
    )
