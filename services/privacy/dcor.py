"""Distance correlation (Szekely, Rizzo and Bakirov, "Measuring and testing dependence by
correlation of distances", Annals of Statistics 35(6), 2007), the empirical V-statistic form.

With a_kl = |x_k - x_l| and A_kl = a_kl - mean_l a_kl - mean_k a_kl + mean_kl a_kl (the doubly
centred distance matrix), likewise B for z: dCov^2 = mean(A * B), dVar^2(x) = mean(A * A), and
dCor^2 = dCov^2 / sqrt(dVar^2(x) dVar^2(z)); 0 for independent samples in the limit, 1 when
one is a similarity transform of the other.
"""

from __future__ import annotations

import torch
from torch import Tensor


def _centred_distances(v: Tensor) -> Tensor:
    d = torch.cdist(v, v)
    return d - d.mean(dim=0, keepdim=True) - d.mean(dim=1, keepdim=True) + d.mean()


def distance_correlation(x: Tensor, z: Tensor) -> float:
    """dCor of the rows of `x` and `z` (each flattened to one vector per sample), in [0, 1]."""
    if x.shape[0] != z.shape[0] or x.shape[0] < 2:
        raise ValueError(
            f"distance correlation needs the same number (>= 2) of samples, got "
            f"{x.shape[0]} and {z.shape[0]}"
        )
    a = _centred_distances(x.detach().flatten(1).double())
    b = _centred_distances(z.detach().flatten(1).double())
    dcov2 = (a * b).mean()
    denominator = ((a * a).mean() * (b * b).mean()).sqrt()
    if float(denominator) == 0.0:
        return 0.0  # a constant sample: no dependence to measure
    return float((dcov2 / denominator).clamp(min=0.0).sqrt())
