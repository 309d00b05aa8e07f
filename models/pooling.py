"""Max-pooling whose evaluation is fast on CPU.

torch's CPU max-pool kernel (NCHW) is several times slower than the convolutions around it in
the small CNNs here, and evaluation (the clients' local accuracy, the aggregator's test sets,
inference) runs it at every forward. Without autograd, a 2x2 window of stride 2 is the maximum
of four strided slices: the same values, far cheaper. With autograd the module is
`nn.MaxPool2d` unchanged, so training and its gradients do not move by a bit.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


class MaxPool2d(nn.MaxPool2d):
    """`nn.MaxPool2d`, with the slice path for a plain 2x2/2 window on CPU without autograd."""

    def forward(self, x: Tensor) -> Tensor:
        if self._by_slices(x):
            return max_pool_2x2(x)
        out: Tensor = super().forward(x)
        return out

    def _by_slices(self, x: Tensor) -> bool:
        plain = (
            self.kernel_size in (2, (2, 2))
            and self.stride in (2, (2, 2))
            and self.padding in (0, (0, 0))
            and self.dilation in (1, (1, 1))
            and not self.ceil_mode
            and not self.return_indices
        )
        training = torch.is_grad_enabled() and x.requires_grad
        return plain and not training and x.device.type == "cpu" and x.dim() in (3, 4)


def max_pool_2x2(x: Tensor) -> Tensor:
    """2x2 max-pooling of stride 2 over the last two dimensions (an odd last row or column is
    dropped, as `nn.MaxPool2d` drops it); NaN propagates, as there."""
    h, w = x.shape[-2] // 2 * 2, x.shape[-1] // 2 * 2
    x = x[..., :h, :w]
    top = torch.maximum(x[..., 0::2, 0::2], x[..., 0::2, 1::2])
    bottom = torch.maximum(x[..., 1::2, 0::2], x[..., 1::2, 1::2])
    return torch.maximum(top, bottom)
