"""Scores of an attack: the ROC AUC of a label attack, the fidelity of a reconstruction."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor


def roc_auc(scores: Tensor, positive: Tensor) -> float:
    """Area under the ROC curve of `scores` ranking the `positive` (bool) samples first: the
    probability that a random positive outscores a random negative, ties counting half
    (the Mann-Whitney U statistic over n_pos * n_neg). NaN when a class is absent."""
    scores = scores.detach().flatten().double()
    positive = positive.flatten().bool()
    n_pos = int(positive.sum())
    n_neg = positive.numel() - n_pos
    if n_pos == 0 or n_neg == 0:
        return math.nan
    _, inverse, counts = torch.unique(scores, return_inverse=True, return_counts=True)
    ends = counts.cumsum(0).double()  # 1-based rank of the last member of each tied group
    mean_rank = ends - (counts.double() - 1) / 2
    rank_sum = float(mean_rank[inverse][positive].sum())
    return (rank_sum - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg)


def mse_per_image(reconstructed: Tensor, original: Tensor) -> Tensor:
    return ((reconstructed - original) ** 2).flatten(1).mean(dim=1)


def psnr(mse: Tensor, peak: float = 1.0) -> Tensor:
    """Peak signal-to-noise ratio in dB of per-image MSEs on a [0, peak] scale."""
    return 10 * torch.log10(peak**2 / mse.clamp(min=1e-10))


def ssim(a: Tensor, b: Tensor, *, window: int = 11, sigma: float = 1.5) -> Tensor:
    """Mean structural similarity per image (Wang, Bovik, Sheikh and Simoncelli, "Image
    quality assessment: from error visibility to structural similarity", IEEE TIP 2004) of
    [N, C, H, W] images on [0, 1], with their 11x11 Gaussian window (sigma 1.5), K1 = 0.01,
    K2 = 0.03, valid positions only, averaged over channels and positions."""
    channels = a.shape[1]
    coords = torch.arange(window, dtype=a.dtype) - (window - 1) / 2
    g = torch.exp(-(coords**2) / (2 * sigma**2))
    g = g / g.sum()
    kernel = (g[:, None] * g[None, :]).expand(channels, 1, window, window).contiguous()

    def blur(v: Tensor) -> Tensor:
        return F.conv2d(v, kernel, groups=channels)

    mu_a, mu_b = blur(a), blur(b)
    var_a = blur(a * a) - mu_a**2
    var_b = blur(b * b) - mu_b**2
    cov = blur(a * b) - mu_a * mu_b
    c1, c2 = 0.01**2, 0.03**2
    index = ((2 * mu_a * mu_b + c1) * (2 * cov + c2)) / (
        (mu_a**2 + mu_b**2 + c1) * (var_a + var_b + c2)
    )
    return index.flatten(1).mean(dim=1)
