"""`splitmq coordinator|aggregator|worker|client CONFIG`: one role as its own process, and
`splitmq autoscale CONFIG`, which sizes the job's worker pool by load ([autoscaler] settings).

These are what compose services and `splitmq up` start. Each needs the real broker and store
(the in-memory ones live inside one process), stops gracefully on SIGTERM / Ctrl-C, and exits
non-zero when the role dies: with the traceback in its log for a bug, in one log line for a
user's error (`services.common.user_errors`). The four roles wait up to
`doctor.START_WAIT_S` for their broker and store before they start.
"""

from __future__ import annotations

import ctypes
import logging
import os
from collections.abc import Callable
from contextlib import AbstractContextManager, closing
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Literal

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
    report_dir_option,
    require_servers,
    run_report,
    stop_on_signals,
)
from services.common.backends import Backends
from services.common.health import FileHealthBeat, HealthBeat
from services.common.logs import ContextValue
from services.common.supervise import JobFailedError, Role, RoleKind
from services.config.root import Settings
from services.runtime.doctor import StartInterrupted, check_services
from services.runtime.threads import budgeted, say_budget, shared_by, sharing_env
from services.security.identity import HOST_ID_MAX, amqp_user, default_client_id, user_host

if TYPE_CHECKING:
    from services.report.records import MetricsSink


def _serve(
    settings: Settings,
    kind: RoleKind,
    factory: Callable[[Settings, Backends], Role],
    log: LogOptions,
    context: dict[str, ContextValue] | None = None,
) -> bool:
    """Run one role until it ends or a signal stops it; True if stopped by a signal.

    `factory` is called once the broker and store answered: it imports the roles (and torch),
    so a wrong URL or password is reported before seconds of imports, not after."""
    # Clients talk only to the broker (design §3): they need no store at all.
    require_servers(settings, kind, store=kind != "client")
    context = context or {}
    with log.logging(settings, {"role": kind, "job": settings.job.name, **context}):
        logger = logging.getLogger(f"splitmq.{kind}")
        backends = Backends(settings.broker, settings.store)
        # `splitmq check <kind>` (the containers' healthcheck) reads this key.
        instance = str(context.get(kind) or default_member_id(f"{kind}-"))
        with stop_on_signals() as stop:
            # A wrong URL, a refused password or a server that is not there: one line now,
            # not after the outage budget (the logging folds user errors into their line).
            failed = "could not start"
            try:
                check_services(backends, settings.job.name, store=kind != "client", stop=stop)
                health: AbstractContextManager[object] = (
                    FileHealthBeat(settings.job.name, kind, instance)  # no Redis for edge clients
                    if kind == "client"
                    # The health key must lapse during an outage: a raw store, no waiting.
                    else HealthBeat(
                        partial(backends.open_store, wait=False), settings.job.name, kind, instance
                    )
                )
                from services.runtime.observe import observe_role

                observation = observe_role(settings, kind, backends, echo=click.echo)
                # After the check: the budget imports torch, seconds a wrong URL need not wait.
                with health, observation as seen, budgeted(settings) as applied:
                    role = factory(settings, seen.backends)
                    # Said once the role is built: a user error in its arguments stays the
                    # one line it is (tests/integration/test_cli_user_errors.py).
                    say_budget(logger, settings, applied)
                    failed = "died"
                    role.run(stop)
            except StartInterrupted:
                pass
            except JobFailedError as exc:
                # The job ended (its report says failed, `splitmq up` exits non-zero on it): exit
                # 0, since a restart (compose's on-failure) would only wait for dismissed clients.
                logger.error("job %s failed: %s", settings.job.name, exc)
            except Exception:
                logger.exception("%s of job %s %s", kind, settings.job.name, failed)
                raise click.exceptions.Exit(1) from None
        if stop.is_set():
            logger.info("%s of job %s stopped", kind, settings.job.name)
        return stop.is_set()


@click.command()
@config_argument
@log_options
def coordinator(config: Path | None, log: LogOptions) -> None:
    """Run the coordinator (membership, shard assignment).

    It admits clients (Join → Welcome with shard, cut and weights), tracks heartbeats and
    drops members whose heartbeats stop.
    """

    def factory(settings: Settings, backends: Backends) -> Role:
        from services.runtime.roles import build_coordinator

        return build_coordinator(settings, backends)

    _serve(load(config)[1], "coordinator", factory, log)


@click.command()
@config_argument
@click.option("--id", "worker_id", help="Worker id (default: worker-HOSTNAME-PID-RANDOM).")
@log_options
def worker(config: Path | None, worker_id: str | None, log: LogOptions) -> None:
    """Run a worker (trains the server-side layers).

    It leases shards, consumes their smashed data, steps the shard replica and replies with
    gradients; uses CUDA when present. Scale out by starting more.
    """
    wid = worker_id or default_member_id("worker-")

    def factory(settings: Settings, backends: Backends) -> Role:
        from services.runtime.roles import build_worker

        return build_worker(settings, backends, worker_id=wid)

    _serve(load(config)[1], "worker", factory, log, {"worker": wid})


@click.command()
@config_argument
@click.option("--id", "client_id", help="Client id (default: client-HOSTNAME-PID-RANDOM).")
@click.option(
    "--partition",
    type=click.IntRange(min=0),
    help="Which data partition this simulated client trains on (default: the coordinator's).",
)
@log_options
def client(
    config: Path | None, client_id: str | None, partition: int | None, log: LogOptions
) -> None:
    """Run one edge client (simulated, on its data partition).

    It trains the client-side layers, publishes smashed data to its shard, applies the
    returned gradients and uploads its weights at the end of each round.
    """
    _, settings = load(config)
    # In the secured mode a client is who its RabbitMQ user is (`splitmq provision-clients`).
    secured = settings.security.per_client_users
    cid = client_id or (default_client_id(settings) if secured else default_member_id("client-"))

    def factory(settings: Settings, backends: Backends) -> Role:
        from services.runtime.roles import build_client

        return build_client(settings, backends, client_id=cid, partition=partition)

    _serve(settings, "client", factory, log, {"client": cid})


@click.command()
@config_argument
@click.option("--count", type=click.IntRange(min=1), required=True, help="How many clients to run.")
@click.option(
    "--first",
    type=click.IntRange(min=0),
    default=0,
    show_default=True,
    help="Index of the first client: they are HOST-FIRST .. HOST-(FIRST+COUNT-1), and client i "
    "trains on data partition i (hosts of one job take disjoint ranges).",
)
@click.option("--host", "host_id", help="Host id (default: host-HOSTNAME-PID-RANDOM).")
@click.option(
    "--partitions",
    type=click.Choice(["index", "coordinator"]),
    default="index",
    show_default=True,
    help="index: client i trains partition i; coordinator: the coordinator assigns free ones "
    "(for hosts started alike, e.g. `docker compose up --scale clients=M`).",
)
@click.option(
    "--trace",
    "trace_file",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="Availability trace (CSV client,online_from_s,online_to_s; docs/traces.md): each "
    "client is online only in its intervals. Default: always online.",
)
@click.option(
    "--time-scale",
    type=click.FloatRange(min=0, min_open=True),
    default=1.0,
    show_default=True,
    help="Multiply the trace's times by this (0.01 replays a 10,000 s trace in 100 s).",
)
@click.option(
    "--offline",
    type=click.Choice(["vanish", "leave"]),
    default="vanish",
    show_default=True,
    help="How a client goes offline: vanish (no word; the coordinator expires it) or leave.",
)
@click.option(
    "--spill-dir",
    type=click.Path(file_okay=False, path_type=Path),
    help="Keep idle clients' algorithm memory here (safetensors) instead of in RAM.",
)
@click.option(
    "--join-rate",
    type=click.FloatRange(min=0, min_open=True),
    default=100.0,
    show_default=True,
    help="Clients started per second at most.",
)
@click.option(
    "--connections",
    type=click.IntRange(min=1, max=64),
    default=4,
    show_default=True,
    help="Publishing connections shared by the clients (plus one consuming).",
)
@click.option(
    "--stats-file",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Write the host's and each client's counters here as JSON when it ends.",
)
@log_options
def clients(
    config: Path | None,
    count: int,
    first: int,
    host_id: str | None,
    partitions: str,
    trace_file: Path | None,
    time_scale: float,
    offline: Literal["vanish", "leave"],
    spill_dir: Path | None,
    join_rate: float,
    connections: int,
    stats_file: Path | None,
    log: LogOptions,
) -> None:
    """Run COUNT simulated clients in one process: a client host.

    They share a handful of connections, one reply queue and one heartbeat, one copy of the
    dataset and of the model code; a model is held only while a client trains
    (docs/architecture.md, "Client hosts").
    """
    from services.client.traces import Trace

    _, settings = load(config)
    _fewer_malloc_arenas()
    # In the secured mode a host is who its RabbitMQ user is (`provision-clients --hosts`).
    user = amqp_user(settings.broker.amqp_url)
    own = user_host(settings.job.name, user) if settings.security.per_client_users else None
    host = host_id or own or default_member_id("host-")[:HOST_ID_MAX]
    online = None
    if trace_file is not None:
        online = Trace.load(trace_file).scaled(time_scale).intervals

    def factory(settings: Settings, backends: Backends) -> Role:
        from services.client.host import ClientHost, always_online
        from services.runtime.roles import preload_optimizer_code

        preload_optimizer_code()
        return ClientHost(
            settings,
            backends.for_role("client", host),
            host=host,
            count=count,
            first=first,
            by_index=partitions == "index",
            online=online or always_online,
            offline=offline,
            spill_dir=spill_dir,
            join_rate=join_rate,
            publishers=connections,
            stats_file=stats_file,
        )

    # The host's clients compute at once, each on its thread: they share the cores.
    _serve(shared_by(settings, count), "client", factory, log, {"client": host})


# glibc's mallopt parameter for the most arenas (malloc.h).
_M_ARENA_MAX = -8


def _fewer_malloc_arenas() -> None:
    """glibc gives a process's threads up to 8 malloc arenas per core, and each arena keeps
    what its threads freed; a host's hundreds of client threads then hold far more than they
    use (docs/architecture.md, "Inside a host"). Two arenas keep the RSS near what is in use, at
    no measurable cost here. Without glibc, nothing happens."""
    try:
        ctypes.CDLL("libc.so.6").mallopt(_M_ARENA_MAX, 2)
    except (OSError, AttributeError):
        pass


@click.command()
@config_argument
@report_dir_option
# `splitmq up` names the exact run directory so it can print the summary afterwards.
@click.option("--run-dir", type=click.Path(file_okay=False, path_type=Path), hidden=True)
@click.option("--summary/--no-summary", default=True, hidden=True)
# `splitmq up --resume`: go on with the metrics of the run in --run-dir.
@click.option("--resume", is_flag=True, hidden=True)
@log_options
def aggregator(
    config: Path | None,
    report_dir: Path | None,
    run_dir: Path | None,
    summary: bool,
    resume: bool,
    log: LogOptions,
) -> None:
    """Run the aggregator (rounds, version v+1, report).

    It opens and closes rounds, aggregates client updates and shard replicas into version
    v+1, evaluates it and writes the run directory.
    """
    _, settings = load(config)
    require_servers(settings, "aggregator")
    if resume and run_dir is None:
        raise click.UsageError("--resume goes on with the run in --run-dir; name it")
    # The run header and metrics.json say the threads torch runs with: set them first. The
    # schedule record's header takes them too (`keep_job_model` runs inside the budget): in
    # `splitmq up` the aggregator's share is the workers', which a replay must compute with.
    with budgeted(settings):
        files, sink = run_report(settings, report_dir, run_dir, resume=resume)
        try:
            stopped = _serve(settings, "aggregator", partial(_aggregator, sink=sink), log)
        except click.exceptions.Exit:
            # Its own error line said why; a store it could not reach gets no second one.
            keep_job_model(settings, files.run_dir, "aggregator", "splitmq.aggregator", quiet=True)
            files.finish("failed: aggregator died (see its log)")
            raise
        keep_job_model(settings, files.run_dir, "aggregator", "splitmq.aggregator")
    files.finish("stopped" if stopped else "finished")
    if summary:
        click.echo(files.summary, nl=False)
        from services.report.final_model import MODEL_FILE

        if (files.run_dir / MODEL_FILE).is_file():
            click.echo(f"  trained model            {files.run_dir / MODEL_FILE}")


def keep_job_model(
    settings: Settings, run_dir: Path, who: str, logger: str, *, quiet: bool = False
) -> None:
    """The job's last version (model.safetensors) and its schedule record (schedule.jsonl.gz)
    from the store into `run_dir`, as an embedded run keeps them (`keep_model`). The
    aggregator does it when the job ends, in a distributed run as in `splitmq up`; a store
    that cannot be reached is said in one line (`quiet`: logged only): the metrics are the
    run's record."""
    from broker.errors import SplitMQError
    from services.runtime.embedded import keep_model

    backends = Backends(settings.broker, settings.store)
    try:
        with closing(backends.open_store(give_up_after=10.0)) as store:
            keep_model(settings, store, run_dir, logging.getLogger(logger))
    except SplitMQError as exc:
        if quiet:
            logging.getLogger(logger).debug("could not keep the trained model: %s", exc)
        else:
            click.echo(f"{who}: could not keep the trained model: {exc}", err=True)


def make_pool(settings: Settings, config: Path, log_dir: Path | None) -> WorkerPool:
    section = settings.autoscaler
    if section.backend == "docker":
        try:
            client = docker_client()
        except DockerUnavailableError as exc:
            raise click.ClickException(str(exc)) from None
        return DockerPool(client, section.docker_project, section.docker_service)
    # Its workers share this host's cores: each gets its part of them when all are running.
    return LocalProcessPool(
        config.resolve(),
        sharing_env(os.environ, settings.runtime, section.max_workers),
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


def _aggregator(settings: Settings, backends: Backends, *, sink: MetricsSink) -> Role:
    from services.runtime.roles import build_aggregator

    return build_aggregator(settings, backends, sink=sink)
