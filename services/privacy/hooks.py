"""A case's defences as the loop's hooks, built from the service's own defence functions
(`services.algorithms.defences`), so the attacks measure what a client really sends."""

from __future__ import annotations

from functools import partial

import torch
from torch import Tensor

from services.algorithms.defences import add_noise, defend, nopeek_loss
from services.privacy.loop import ClientHooks
from services.privacy.sweep import Case


def hooks_for(case: Case, seed: int) -> ClientHooks:
    """Clipping then noise on z, noise on the returned dL/dh, NoPeek on (x, z'), each as the
    case sets it; the noise comes from one generator seeded with `seed`."""
    generator = torch.Generator().manual_seed(seed)
    clip = case.clip or None

    def smashed(z: Tensor) -> Tensor:
        return defend(z, case.noise, clip, generator)

    def gradient(g: Tensor) -> Tensor:
        return add_noise(g, case.gradient_noise, generator)

    regulariser = partial(nopeek_loss, weight=case.nopeek) if case.nopeek else None
    return ClientHooks(smashed=smashed, gradient=gradient, regulariser=regulariser)
