"""The root of a SplitMQ configuration file: connections, the job description, [metrics],
[autoscaler] and [runtime]."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from broker.topology import job_queues
from broker.transport import QueueSpec
from services.config.job import JobConfig
from services.config.runtime import RuntimeSection
from services.config.settings import ConnectionSettings, _Section

# Where each kind of process starts looking for a free port, relative to `port`.
PORT_OFFSETS: dict[str, int] = {
    "coordinator": 0,  # also serves the dashboard
    "run": 0,  # `splitmq run`: every role in one process, dashboard included
    "aggregator": 1,
    "dashboard": 2,  # `splitmq dashboard CONFIG`
    "worker": 10,  # worker processes take 9410, 9411, ... in start order
    "client": 100,
}


class MetricsSection(_Section):
    """`[metrics]`: the Prometheus endpoint each role serves, and the live dashboard. Every
    process of a job serves `/metrics` on its own port so several fit on one machine: it starts
    at `port` plus its offset and takes the first free port within `port_span`
    (docs/deployment.md, "Prometheus endpoints")."""

    enabled: bool = True
    # Loopback by default; "0.0.0.0" to be scraped from other hosts or containers.
    host: str = "127.0.0.1"
    # Base port (0: any free port, chosen by the operating system).
    port: int = Field(default=9400, ge=0, le=65535)
    # How many ports after its own a process tries before giving up on serving metrics.
    port_span: int = Field(default=64, ge=1, le=1000)
    # Serve the dashboard page from the coordinator and from `splitmq run`.
    dashboard: bool = True
    # How often queue depths, members and the version are sampled (and the page refreshed).
    probe_s: float = Field(default=1.0, gt=0)

    def first_port(self, kind: str) -> int:
        """The port a process of `kind` tries first (0: let the OS choose)."""
        return 0 if self.port == 0 else min(65535, self.port + PORT_OFFSETS.get(kind, 0))


class AutoscalerSection(_Section):
    """`[autoscaler]`: how `splitmq autoscale` sizes the worker pool (services/autoscaler; the
    rule these settings feed: docs/deployment.md, "Autoscaling workers")."""

    min_workers: int = Field(default=1, ge=0)
    # Workers beyond the job's shard count would idle (each shard has one holder): the
    # autoscaler never goes past S whatever this says.
    max_workers: int = Field(default=4, ge=1)
    target_depth_per_worker: int = Field(default=32, ge=1)
    scale_up_busy: float = Field(default=0.75, gt=0, le=1)
    scale_down_busy: float = Field(default=0.25, ge=0, lt=1)
    cooldown_s: float = Field(default=30.0, ge=0)
    scale_down_after_s: float = Field(default=60.0, ge=0)
    poll_s: float = Field(default=2.0, gt=0)
    backend: Literal["local", "docker"] = "local"
    # When the autoscaler itself stops: how long its local workers get to hand over before
    # they are killed (scaling down never kills; it waits for the worker to exit).
    stop_timeout_s: float = Field(default=120.0, gt=0)
    # Docker backend: the compose project and service whose containers are the workers.
    docker_project: str = "splitmq"
    docker_service: str = "worker"

    @model_validator(mode="after")
    def _consistent(self) -> AutoscalerSection:
        if self.min_workers > self.max_workers:
            raise ValueError(
                f"min_workers ({self.min_workers}) exceeds max_workers ({self.max_workers})"
            )
        if self.scale_down_busy >= self.scale_up_busy:
            raise ValueError(
                f"scale_down_busy ({self.scale_down_busy}) must be below scale_up_busy "
                f"({self.scale_up_busy}): the gap between them is the hysteresis"
            )
        return self


class Settings(ConnectionSettings, JobConfig):
    """Everything one TOML file can hold; every role is built from one of these."""

    autoscaler: AutoscalerSection = AutoscalerSection()
    metrics: MetricsSection = MetricsSection()
    runtime: RuntimeSection = RuntimeSection()

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
