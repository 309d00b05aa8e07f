"""`[autoscaler]`: how `splitmq autoscale` sizes the worker pool (services/autoscaler; the
rule these settings feed: docs/deployment.md, "Autoscaling workers")."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from services.config.settings import _Section


class AutoscalerSection(_Section):
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
