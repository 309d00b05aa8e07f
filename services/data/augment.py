"""Random crop with black padding and horizontal flip of a whole batch, in torch.

torchvision's ``RandomCrop(size, padding=p)`` and ``RandomHorizontalFlip()``, done in one
gather over the batch instead of a Python loop over its images. The batch is already
normalised (`services.data.loaders`), so "black" is each channel's normalised zero,
``-mean / std``, as the papers' pipelines pad before normalising. The draws come from a
generator the caller seeds, on the CPU, so a batch augments the same on any device.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from services.data.registry import Augmentation, DatasetInfo

# Keeps the augmentation streams apart from the shuffle streams of the same (seed, client,
# epoch) in `services.data.batches`.
_STREAM = 0xA6


def batch_generator(*, seed: int, client: int, epoch: int, batch: int) -> torch.Generator:
    """The generator of one training batch: any process replays it from these four numbers."""
    words = np.random.SeedSequence([seed, client, epoch, batch, _STREAM]).generate_state(2)
    return torch.Generator().manual_seed(int(words[0]) << 32 | int(words[1]))


@dataclass(frozen=True, eq=False)
class Augmenter:
    """Augments [B, C, H, W] batches as `params` says; `fill` is the padding, per channel."""

    params: Augmentation
    fill: torch.Tensor

    @classmethod
    def for_data(cls, params: Augmentation, info: DatasetInfo) -> Augmenter:
        """The augmenter of `params` on a dataset described by `info` (images only)."""
        if not info.is_image:
            raise ValueError(
                f"[data.augment] crops and flips images; {info.name}'s samples are "
                f"{info.input_shape} vectors: set crop_padding = 0 and horizontal_flip = false"
            )
        channels = info.input_shape[0]
        if info.mean:
            fill = [-m / s for m, s in zip(info.mean, info.std, strict=True)]
        else:
            fill = [0.0] * channels
        return cls(params, torch.tensor(fill, dtype=torch.float32))

    def __call__(self, x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """A new tensor: each image shifted by up to ``crop_padding`` pixels each way (the
        uncovered border black) and, with ``horizontal_flip``, mirrored with probability 1/2."""
        b, c, h, w = x.shape
        p = self.params.crop_padding
        shifts = torch.randint(0, 2 * p + 1, (2, b), generator=generator) - p
        flips = (
            torch.rand(b, generator=generator) < 0.5
            if self.params.horizontal_flip
            else torch.zeros(b, dtype=torch.bool)
        )
        if not p:  # a flip alone moves no pixel off the image: no gather, no border
            return torch.where(flips.to(x.device).view(b, 1, 1, 1), x.flip(3), x)
        # Output pixel (i, j) of image k is input pixel (i + dy_k, j + dx_k) of the padded
        # crop, or (i + dy_k, w - 1 - j + dx_k) when image k is flipped (crop, then flip), and
        # black where that falls outside the image: one gather over the batch, no padded copy.
        j = torch.arange(w)
        rows = torch.arange(h) + shifts[0].view(b, 1)
        cols = torch.where(flips.view(b, 1), w - 1 - j, j) + shifts[1].view(b, 1)
        inside = ((rows >= 0) & (rows < h)).view(b, 1, h, 1) & ((cols >= 0) & (cols < w)).view(
            b, 1, 1, w
        )
        flat = rows.clamp(0, h - 1).view(b, h, 1) * w + cols.clamp(0, w - 1).view(b, 1, w)
        flat, inside = flat.to(x.device), inside.to(x.device)
        picked = x.reshape(b, c, h * w).gather(2, flat.view(b, 1, h * w).expand(b, c, h * w))
        fill = self.fill.to(x.device, x.dtype).view(1, c, 1, 1)
        return torch.where(inside, picked.view(b, c, h, w), fill)
