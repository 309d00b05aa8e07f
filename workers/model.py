"""The job's model, hyper-parameters and device as a worker needs them."""

from __future__ import annotations

from collections.abc import Callable

import torch

from models.registry import build_model
from models.split import SplitNet
from services.algorithms.base import Hyper
from services.config.root import Settings
from services.data.registry import get_spec

ModelFactory = Callable[[], SplitNet]


def job_model(settings: Settings) -> SplitNet:
    """The job's `SplitNet`, shaped for its dataset's images.

    Its initial weights do not matter to a worker (replicas load published versions), so it is
    built under a forked RNG: the embedded runner's other roles keep their seeded streams.
    """
    spec = get_spec(settings.data.dataset)
    if spec.height != spec.width:
        raise ValueError(f"dataset {spec.name!r} is not square ({spec.height}x{spec.width})")
    with torch.random.fork_rng(devices=[]):
        return build_model(
            settings.model.name,
            num_classes=settings.model.num_classes,
            in_channels=spec.channels,
            input_size=spec.height,
        )


def job_hyper(settings: Settings) -> Hyper:
    algorithm = settings.algorithm
    return Hyper(
        lr=algorithm.lr,
        momentum=algorithm.momentum,
        server_lr=algorithm.server_lr,
        local_epochs=algorithm.local_epochs,
        max_steps=algorithm.max_steps_per_round,
    )


def pick_device(setting: str, *, cuda_available: Callable[[], bool] | None = None) -> torch.device:
    """`auto` is CUDA when present, else the CPU; asking for CUDA without one is an error."""
    available = (cuda_available or torch.cuda.is_available)()
    if setting == "cpu":
        return torch.device("cpu")
    if setting == "cuda" and not available:
        raise ValueError("workers.device = 'cuda' but no CUDA device is available")
    return torch.device("cuda" if available else "cpu")
