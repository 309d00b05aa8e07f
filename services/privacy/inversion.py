"""Input reconstruction by an inverse network (He, Zhang and Lee, "Model Inversion Attacks
against Collaborative Inference", ACSAC 2019, the black-box setting): the server, holding
public data from the same distribution, learns a decoder g with g(z) ~ x by minimising
||g(z) - x||^2 over (x, z = client(x)) pairs of that data, then applies it to the smashed data
of the client's private images.

Here the public data is the test split (the client never trains on it) and the private
images are training images; the decoder sees z after the client's smashed-data defence, with
fresh noise each epoch, as the server would.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from services.privacy.loop import Transform
from services.privacy.metrics import mse_per_image, psnr, ssim


def decoder_for(z_shape: Sequence[int], x_shape: Sequence[int], width: int = 32) -> nn.Module:
    """A small decoder from activations of `z_shape` to images of `x_shape` (C, H, W): a
    feature map is widened by a 3x3 conv, resized to the image by bilinear upsampling and
    refined by two 3x3 convs; a vector first goes through a linear layer to a quarter-size
    map."""
    channels, height, width_px = x_shape
    stem: list[nn.Module]
    if len(z_shape) == 3:
        stem = [nn.Conv2d(z_shape[0], width, 3, padding=1), nn.ReLU()]
    else:
        features = 1
        for d in z_shape:
            features *= int(d)
        small = (height // 4, width_px // 4)
        stem = [
            nn.Flatten(),
            nn.Linear(features, width * small[0] * small[1]),
            nn.ReLU(),
            nn.Unflatten(1, (width, *small)),
        ]
    return nn.Sequential(
        *stem,
        nn.Upsample(size=(height, width_px), mode="bilinear", align_corners=False),
        nn.Conv2d(width, width, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(width, width, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(width, channels, 3, padding=1),
    )


@dataclass(frozen=True)
class DecoderTraining:
    epochs: int = 3
    batch_size: int = 64
    lr: float = 1e-3
    width: int = 32
    seed: int = 0


def train_decoder(
    z_public: Tensor, x_public: Tensor, defence: Transform, training: DecoderTraining
) -> nn.Module:
    """A decoder fitted (Adam, MSE on normalised pixels) to map defence(z) back to x."""
    generator = torch.Generator().manual_seed(training.seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(training.seed)
        decoder = decoder_for(z_public.shape[1:], x_public.shape[1:], training.width)
        optimizer = torch.optim.Adam(decoder.parameters(), lr=training.lr)
        decoder.train()
        for _ in range(training.epochs):
            order = torch.randperm(len(x_public), generator=generator)
            for start in range(0, len(order), training.batch_size):
                index = order[start : start + training.batch_size]
                with torch.no_grad():
                    z = defence(z_public[index])
                loss = ((decoder(z) - x_public[index]) ** 2).mean()
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
    decoder.eval()
    return decoder


@dataclass(frozen=True)
class Reconstruction:
    mse: float
    psnr_db: float
    ssim: float
    baseline_mse: float
    """The MSE of always answering the public data's mean image (what knowing nothing gives)."""
    baseline_psnr_db: float
    images: Tensor
    """The first private images on [0, 1], and their reconstructions after them: [2k, C, H, W]."""


def evaluate_decoder(
    decoder: nn.Module,
    z_private: Tensor,
    x_private: Tensor,
    x_public: Tensor,
    defence: Transform,
    to_unit: Transform,
    *,
    shown: int = 8,
    batch: int = 512,
) -> Reconstruction:
    """Fidelity of the decoder's reconstructions of private images, on the [0, 1] pixel scale
    (`to_unit` undoes the dataset's normalisation; reconstructions are clamped to [0, 1])."""
    with torch.no_grad():
        parts = [
            decoder(defence(z_private[i : i + batch])) for i in range(0, len(z_private), batch)
        ]
        recon = to_unit(torch.cat(parts)).clamp(0, 1)
        original = to_unit(x_private).clamp(0, 1)
        mean_image = to_unit(x_public).clamp(0, 1).mean(dim=0, keepdim=True)
    mse = mse_per_image(recon, original)
    baseline = mse_per_image(mean_image.expand_as(original), original)
    return Reconstruction(
        mse=float(mse.mean()),
        psnr_db=float(psnr(mse).mean()),
        ssim=float(ssim(recon, original).mean()),
        baseline_mse=float(baseline.mean()),
        baseline_psnr_db=float(psnr(baseline).mean()),
        images=torch.cat([original[:shown], recon[:shown]]),
    )
