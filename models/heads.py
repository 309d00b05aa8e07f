"""Auxiliary heads: small classifiers on a cut activation (SplitGP's `h`, FedSplitX's `a_i`).

The default head is deliberately cheap, because a client trains it on an edge device:
- a feature map (C, H, W) is average-pooled to at most `pool` x `pool`, flattened, and fed to
  one linear layer, so it costs C * pool^2 * num_classes weights whatever the resolution (a
  ResNet-18 stem head has 2.6k parameters, not the 655k of a linear layer on 64x32x32);
  pooling to 2x2 rather than 1x1 keeps a little spatial layout, which helps early cuts;
- a vector (F,) gets one linear layer;
- any other shape is flattened and gets one linear layer.
State names are `pool` (no state) and `fc.weight` / `fc.bias`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from torch import Tensor, nn

HeadFactory = Callable[[tuple[int, ...], int], nn.Module]
"""Builds a head from (activation shape without batch, num_classes)."""

DEFAULT_POOL = 2


class AuxHead(nn.Module):
    """Optional adaptive average pool, flatten, linear."""

    def __init__(self, shape: Sequence[int], num_classes: int, pool: int = DEFAULT_POOL) -> None:
        super().__init__()
        if pool < 1:
            raise ValueError(f"pool must be >= 1, got {pool}")
        shape = tuple(shape)
        self.pool: nn.Module
        if len(shape) == 3:
            out_hw = (min(pool, shape[1]), min(pool, shape[2]))
            self.pool = nn.AdaptiveAvgPool2d(out_hw)
            features = shape[0] * out_hw[0] * out_hw[1]
        else:
            self.pool = nn.Identity()
            features = math.prod(shape)
        self.flatten = nn.Flatten()
        self.fc = nn.Linear(features, num_classes)

    def forward(self, z: Tensor) -> Tensor:
        out: Tensor = self.fc(self.flatten(self.pool(z)))
        return out


default_head: HeadFactory = AuxHead
