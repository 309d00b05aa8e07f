"""Start-up: has the job ended already, and if not, its seeded model and version 1
(architecture step 1).

The rule for a job name used again: a job that has a version and a status record (`JobStatus`)
is over, and stays over for every role that starts later; a job without any version is new, so
seeding version 1 first clears whatever status the name had. `splitmq up` (with `--fresh`, its
default) deletes the job's keys before it starts, status included; `splitmq run` starts from an
empty in-memory store; compose keeps Redis on a volume, so only `down -v` starts the job anew.
"""

from __future__ import annotations

import logging

from broker.errors import VersionConflictError
from broker.store import NO_VERSION, JobStatus, WeightStore
from services.aggregator.evaluation import Evaluator
from services.algorithms.base import Strategy
from services.common.jobmodel import job_model
from services.config.root import Settings
from services.data.loaders import Split


def ended_job(store: WeightStore, job: str) -> JobStatus | None:
    """How the job ended, if it has; None when it runs or is new (no version yet: a leftover
    status is cleared when version 1 is seeded)."""
    status = store.job_status(job)
    if status is None or store.current_version(job) == NO_VERSION:
        return None
    return status


def ensure_initial_version(
    store: WeightStore, settings: Settings, strategy: Strategy, logger: logging.Logger
) -> int:
    """Publish version 1 from the seeded model unless some version exists; the current version.

    Two aggregators starting together both build the model, one commits, the other's
    compare-and-set fails and it adopts the winner's version 1 (identical anyway: same seed).
    Seeding starts the job anew: a status left by an earlier run of the name is cleared first
    (before version 1 exists, so no role can take the new run for the old one's end).
    """
    job = settings.job.name
    current = store.current_version(job)
    if current != NO_VERSION:
        return current
    if store.job_status(job) is not None:
        logger.info("job %s: no version yet; clearing the status of an earlier run", job)
        store.clear_job_status(job)
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
