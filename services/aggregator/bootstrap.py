"""Start-up: the job's seeded model and version 1 (architecture step 1)."""

from __future__ import annotations

import logging

from broker.errors import VersionConflictError
from broker.store import NO_VERSION, WeightStore
from services.aggregator.evaluation import Evaluator
from services.algorithms.base import Strategy
from services.config.root import Settings
from services.data.loaders import Split
from services.runtime.jobmodel import job_model


def ensure_initial_version(
    store: WeightStore, settings: Settings, strategy: Strategy, logger: logging.Logger
) -> int:
    """Publish version 1 from the seeded model unless some version exists; the current version.

    Two aggregators starting together both build the model, one commits, the other's
    compare-and-set fails and it adopts the winner's version 1 (identical anyway: same seed).
    """
    job = settings.job.name
    current = store.current_version(job)
    if current != NO_VERSION:
        return current
    model = job_model(settings, seed=settings.job.seed)
    blobs = strategy.initial_weights(model, settings.model.cut)
    try:
        version = store.publish_version(job, NO_VERSION, blobs, meta={"round": "-1"})
    except VersionConflictError as exc:
        logger.info("job %s: version %d was published by someone else", job, exc.actual)
        return store.current_version(job)
    logger.info("job %s: published initial version %d (seed %d)", job, version, settings.job.seed)
    return version


def build_evaluator(settings: Settings, test: Split) -> Evaluator:
    """The job's evaluator on `test` (capped at `data.eval_samples`)."""
    return Evaluator(job_model(settings), test, max_samples=settings.data.eval_samples)
