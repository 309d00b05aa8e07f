"""The job's model, hyper-parameters and device as a worker needs them."""

from __future__ import annotations

from collections.abc import Callable

import torch

from models.split import SplitNet
from services.common.jobmodel import job_hyper, job_model

__all__ = ["ModelFactory", "job_hyper", "job_model", "pick_device"]

ModelFactory = Callable[[], SplitNet]


def pick_device(setting: str, *, cuda_available: Callable[[], bool] | None = None) -> torch.device:
    """`auto` is CUDA when present, else the CPU; asking for CUDA without one is an error."""
    available = (cuda_available or torch.cuda.is_available)()
    if setting == "cpu":
        return torch.device("cpu")
    if setting == "cuda" and not available:
        raise ValueError("workers.device = 'cuda' but no CUDA device is available")
    return torch.device("cuda" if available else "cpu")
