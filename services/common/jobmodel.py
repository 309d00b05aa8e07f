"""The job's model and training parameters, built the same way by every role."""

from __future__ import annotations

import threading

import torch

from models.registry import build_model
from models.split import SplitNet
from services.algorithms.base import Hyper
from services.algorithms.registry import REGISTRY
from services.common.jobdata import job_input_shape
from services.config.root import Settings

# torch's CPU generator is one per process, and fork_rng saves and restores it around the
# build: two threads building at once (the embedded runner starts every role together) mix
# their draws, and the aggregator's seeded version 1 came out different from run to run.
# Builds are therefore serialised; this guards torch's global state, it holds none of ours.
_BUILD_LOCK = threading.Lock()


def job_model(settings: Settings, *, seed: int | None = None) -> SplitNet:
    """The job's `SplitNet` shaped for its dataset's samples, U-shaped when `model.tail` is set
    (`ModelSpecError` when the tail leaves the server no block); seeded when `seed` is given.
    Auxiliary heads are built only for an algorithm that trains them (`uses_heads`); they
    are made after the blocks, so the blocks' initial weights are the same either way.

    Built under a forked RNG, so the caller's random stream is left alone, and one build at a
    time (`_BUILD_LOCK`). Only the aggregator's version 1 depends on these initial weights;
    other roles load published versions.
    """
    shape = job_input_shape(settings)
    with _BUILD_LOCK, torch.random.fork_rng(devices=[]):
        if seed is not None:
            torch.manual_seed(seed)
        model = build_model(
            settings.model.name,
            num_classes=settings.model.num_classes,
            input_shape=shape,
            heads=REGISTRY.get(settings.algorithm.name).strategy.traits.uses_heads,
            **settings.model.options,
        )
    model.set_tail(settings.model.tail, settings.model.cut)
    return model


def job_hyper(settings: Settings) -> Hyper:
    algorithm = settings.algorithm
    return Hyper(
        lr=algorithm.lr,
        momentum=algorithm.momentum,
        server_lr=algorithm.server_lr,
        local_epochs=algorithm.local_epochs,
        max_steps=algorithm.max_steps_per_round,
        optimizers=settings.optimizer,
        schedules=settings.schedule,
        losses=settings.loss,
    )
