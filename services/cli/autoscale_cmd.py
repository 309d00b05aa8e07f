"""`splitmq autoscale CONFIG`: size a job's worker pool by load ([autoscaler] settings)."""

from __future__ import annotations

import os
from pathlib import Path

import click

from services.autoscaler.controller import Autoscaler
from services.autoscaler.docker_pool import DockerPool, DockerUnavailableError, docker_client
from services.autoscaler.local import LocalProcessPool
from services.autoscaler.pool import WorkerPool
from services.cli.common import (
    LogOptions,
    config_argument,
    default_member_id,
    load,
    log_options,
    stop_on_signals,
)
from services.common.backends import Backends
from services.config.root import Settings


def make_pool(settings: Settings, config: Path, log_dir: Path | None) -> WorkerPool:
    section = settings.autoscaler
    if section.backend == "docker":
        try:
            client = docker_client()
        except DockerUnavailableError as exc:
            raise click.ClickException(str(exc)) from None
        return DockerPool(client, section.docker_project, section.docker_service)
    return LocalProcessPool(
        config.resolve(),
        os.environ,
        prefix=default_member_id("auto-"),
        log_dir=log_dir,
        stop_timeout_s=section.stop_timeout_s,
    )


@click.command()
@config_argument
@click.option(
    "--log-dir",
    type=click.Path(file_okay=False, path_type=Path),
    help="Local backend: each worker's output goes to DIR/<worker>.log (default: here).",
)
@log_options
def autoscale(config: Path | None, log_dir: Path | None, log: LogOptions) -> None:
    """Scale the job's workers between [autoscaler] min_workers and max_workers.

    Watches the shard queues' depth and the workers' busy fraction; starts workers under
    load and stops idle ones gracefully (they hand their shards over first). Backends:
    "local" runs `splitmq worker` processes, "docker" the compose project's worker
    containers. On exit, local workers are stopped; containers stay.
    """
    path, settings = load(config)
    if settings.broker.kind != "rabbitmq" or settings.store.kind != "redis":
        raise click.ClickException(
            "`splitmq autoscale` sizes workers in other processes: it needs RabbitMQ and Redis "
            "(SPLITMQ_BROKER=rabbitmq SPLITMQ_STORE=redis)"
        )
    with log.logging(settings, {"role": "autoscaler", "job": settings.job.name}):
        pool = make_pool(settings, path, log_dir)
        with stop_on_signals() as stop:
            backends = Backends(settings.broker, settings.store)
            # `splitmq check autoscaler` (the compose healthcheck) reads its health key.
            instance = default_member_id("autoscaler-")
            Autoscaler(settings, backends, pool, instance=instance).run(stop)
