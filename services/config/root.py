"""The root of a SplitMQ configuration file: connections plus the job description."""

from __future__ import annotations

from services.config.autoscaler import AutoscalerSection
from services.config.job import JobConfig
from services.config.metrics import MetricsSection
from services.config.settings import ConnectionSettings


class Settings(ConnectionSettings, JobConfig):
    """Everything one TOML file can hold; every role is built from one of these."""

    autoscaler: AutoscalerSection = AutoscalerSection()
    metrics: MetricsSection = MetricsSection()
