"""The root of a SplitMQ configuration file: connections plus the job description."""

from __future__ import annotations

from pydantic import model_validator

from broker.topology import job_queues
from broker.transport import QueueSpec
from services.config.autoscaler import AutoscalerSection
from services.config.job import JobConfig
from services.config.metrics import MetricsSection
from services.config.settings import ConnectionSettings


class Settings(ConnectionSettings, JobConfig):
    """Everything one TOML file can hold; every role is built from one of these."""

    autoscaler: AutoscalerSection = AutoscalerSection()
    metrics: MetricsSection = MetricsSection()

    def job_queues(self) -> list[QueueSpec]:
        """The job's server-side queues with the configured bounds (what every role declares)."""
        return job_queues(self.job.name, self.shards, self.broker.queue_limits)

    @model_validator(mode="after")
    def _versions_kept_for_async(self) -> Settings:
        # An async update is rebased against the version it started from, which the store must
        # still hold: the newest and max_staleness older ones.
        kept, bound = self.store.keep_versions, self.asynchronous.max_staleness
        if self.asynchronous_mode and bound >= kept:
            raise ValueError(
                f"asynchronous.max_staleness ({bound}) must be below store.keep_versions "
                f"({kept}): an update is folded against the version it started from"
            )
        return self
