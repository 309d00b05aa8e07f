"""`splitmq run CONFIG`: the whole job in this process, on the in-memory broker and store;
`splitmq up CONFIG`: every role as a local process over RabbitMQ and Redis."""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import replace
from datetime import datetime
from pathlib import Path

import click

from services.cli.common import (
    LogOptions,
    config_argument,
    group_options,
    load,
    log_options,
    read_settings,
    report_dir_option,
    require_reachable,
    run_report,
    stop_on_signals,
)
from services.common.backends import Backends, Embedded
from services.config.root import Settings
from services.report.tables import record_from_dict
from services.runtime.processes import (
    LocalProcesses,
    child_env,
    child_specs,
    clear_job,
    job_version,
    reset_for_resume,
)
from services.runtime.threads import budgeted, shared_by

resume_option = click.option(
    "--resume",
    "resume_dir",
    metavar="RUN_DIR",
    type=click.Path(file_okay=False, path_type=Path),
    help="Go on with a stopped run in its run directory RUN_DIR, from its last version: "
    "metrics appended there, elapsed time continued. CONFIG must be the run's (job.rounds "
    "may be raised); see README, 'Stopping and resuming'.",
)


def _resume_here(report_dir: Path | None, resume_dir: Path | None) -> None:
    if resume_dir is not None and report_dir is not None:
        raise click.UsageError("--resume goes on in RUN_DIR itself: leave out --report-dir")


@click.command()
@config_argument
@report_dir_option
@resume_option
@click.option(
    "--linger",
    type=click.FloatRange(min=0),
    default=0.0,
    help="Keep serving the dashboard and metrics this many seconds after the run ends "
    "(Ctrl-C ends it sooner).",
)
@log_options
def run(
    config: Path | None,
    report_dir: Path | None,
    resume_dir: Path | None,
    linger: float,
    log: LogOptions,
) -> None:
    """Run a whole job in this process (no servers needed).

    Every role runs on a thread over the in-memory broker and store; prints one line per
    round and a summary, and writes the run directory. Serves /metrics and the live
    dashboard while it runs (see [metrics]). Ctrl-C stops it; `--resume RUN_DIR` goes on
    from the last version the run directory keeps.
    """
    from services.common.jobdata import load_job_dataset
    from services.report.resume import saved_version
    from services.runtime.embedded import force_embedded, run_embedded
    from services.runtime.observe import observed

    _resume_here(report_dir, resume_dir)
    _, settings = load(config)
    settings = _embedded_threads(settings)
    # Progress lines say what happens; role logs below WARNING would drown them. The thread
    # budget is set before the run header, which shows it.
    logs = log.logging(settings, {"job": settings.job.name}, default="WARNING")
    with logs, budgeted(settings):
        settings = force_embedded(settings, logging.getLogger("splitmq.runtime"))
        saved = saved_version(resume_dir, settings) if resume_dir is not None else None
        dataset = load_job_dataset(settings)  # a DataError is one line (services.cli.common)
        sink, both = run_report(settings, report_dir, resume_dir, resume=saved is not None)
        if saved is not None:
            click.echo(f"resuming at version {saved.version}: round {saved.version} next")
        watch = observed(
            settings,
            "run",
            Backends(settings.broker, settings.store, Embedded()),
            echo=click.echo,
            dashboard=settings.metrics.dashboard,
            watch=True,
            run_dir=sink.run_dir,
        )
        with stop_on_signals() as stop, watch as seen:
            try:
                outcome = run_embedded(
                    settings,
                    sink=both,
                    stop=stop,
                    dataset=dataset,
                    backends=seen.backends,
                    run_dir=sink.run_dir,
                    resume=saved,
                )
            except Exception:
                # The error boundary says what went wrong: one line for a user's mistake
                # (an unknown model), the traceback for a bug.
                click.echo(f"report: {sink.run_dir}")
                raise
            click.echo("")
            click.echo(sink.summary, nl=False)
            _echo_model(sink.run_dir)
            if linger > 0 and seen.url:
                click.echo(f"serving {seen.url}/ for {linger:g} s more (Ctrl-C to stop)")
                # The run set `stop` when it ended; Ctrl-C now ends the wait.
                with stop_on_signals() as rest:
                    rest.wait(linger)
    if outcome.traceback:
        click.echo(f"\n{outcome.failed_role} failed:\n{outcome.traceback}", err=True)
    if outcome.stuck:
        click.echo(f"roles that did not stop in time: {', '.join(outcome.stuck)}", err=True)
    if outcome.exit_code:
        raise click.exceptions.Exit(outcome.exit_code)


@click.command()
@config_argument
@click.option("--workers", type=click.IntRange(min=1), help="Worker processes.")
@click.option("--clients", type=click.IntRange(min=1), help="Client processes.")
@click.option(
    "--fresh/--no-fresh",
    default=True,
    show_default=True,
    help="Delete the job's queues and store keys before starting (a stale run of the same "
    "job name would otherwise feed old messages and versions into this one). --resume "
    "keeps the versions.",
)
@report_dir_option
@resume_option
@click.option(
    "--timeout",
    type=click.FloatRange(min=0),
    default=0.0,
    help="Give up after this many seconds (0: wait for the job to finish).",
)
@log_options  # the roles' logging: passed on to each of them
def up(
    config: Path | None,
    workers: int | None,
    clients: int | None,
    fresh: bool,
    report_dir: Path | None,
    resume_dir: Path | None,
    timeout: float,
    log: LogOptions,
) -> None:
    """Run every role as a local process (RabbitMQ + Redis).

    Starts the aggregator, the coordinator, the workers and the clients, prefixes their
    output with their names, waits for the job to finish, stops them and prints the summary.
    Ctrl-C stops them all; `--resume RUN_DIR` goes on from the job's version in Redis.
    """
    from services.report.rundir import create_run_dir
    from services.runtime.roles import worker_count

    _resume_here(report_dir, resume_dir)
    path, file_settings = load(config)
    n_workers = workers or file_settings.workers.count
    if not worker_count(file_settings):
        n_workers = 0  # FedAvg: nothing is split, so there is nothing for a worker to train
    n_clients = clients or file_settings.clients.count
    # The children's environment and their exact view of the settings, validated up front;
    # fewer clients than the file's round-1 quorum would never start: lower it to match.
    min_to_start = min(file_settings.clients.min_to_start, n_clients)
    env = child_env(
        os.environ,
        workers=max(n_workers, 1),
        clients=n_clients,
        min_to_start=min_to_start,
        runtime=file_settings.runtime,
    )
    settings = read_settings(path, env)
    require_reachable(settings, "up")
    if resume_dir is not None:
        run_dir = resume_dir
        specs = child_specs(n_workers, n_clients, run_dir, resume=True)
        version = _resume_up(settings, run_dir, [s.name for s in specs if s.role == "client"])
        click.echo(f"splitmq up: resuming job {settings.job.name} at version {version}")
    else:
        run_dir = create_run_dir(
            report_dir or Path(settings.report.dir), settings.job.name, datetime.now()
        )
        specs = child_specs(n_workers, n_clients, run_dir)
        if fresh:
            clear_job(settings, [s.name for s in specs if s.role == "client"])
    click.echo(
        f"splitmq up: job {settings.job.name}: aggregator, coordinator, {n_workers} worker(s), "
        f"{n_clients} client(s); run directory {run_dir}"
    )
    if group_options().debug:  # `splitmq --debug up`: the roles' tracebacks too
        env = {**env, "SPLITMQ_DEBUG": "1"}
    args = (
        *(("--log-json",) if log.json else ()),
        *(("--log-level", log.level) if log.level else ()),
    )
    procs = LocalProcesses(path, specs, env, echo=click.echo, extra_args=args)
    started = time.time()
    with stop_on_signals() as stop:
        procs.start()
        result = procs.wait(stop, timeout)
    click.echo("")
    summary, reported = _report(run_dir)
    click.echo(summary, nl=False)
    _keep_model(settings, run_dir, since=started)
    if result.status == "finished" and reported != "finished":
        # The aggregator exited cleanly but did not finish the job (someone stopped it).
        result = replace(result, status=f"failed: the report says {reported!r}")
    unclean = [f"{n} exited with {c}" for n, c in result.exit_codes.items() if c != 0]
    if unclean:
        # After the job, children get SIGTERM and should stop gracefully with 0.
        click.echo(f"splitmq up: did not stop cleanly: {', '.join(unclean)}", err=True)
    if result.status != "finished":
        click.echo(f"splitmq up: {result.status}", err=True)
    if result.exit_code:
        raise click.exceptions.Exit(result.exit_code)


def _embedded_threads(settings: Settings) -> Settings:
    """The embedded run's settings for its thread budget: its clients and workers are threads
    that compute at once, each with its own OpenMP team, so they divide the cores as
    processes would (services/config/runtime.py). One number for the whole process, set
    before any role starts: torch.set_num_threads is the default that each thread's team
    takes, and the roles that compute are alike (the aggregator evaluates and the coordinator
    routes while they wait). Intra-op threads beyond the share would only spin at barriers
    on cores that another role needs."""
    from services.runtime.roles import worker_count

    return shared_by(settings, settings.clients.count + worker_count(settings))


def _resume_up(settings: Settings, run_dir: Path, client_ids: list[str]) -> int:
    """Check that the stopped run can go on from the job's version in Redis, drop its metrics
    rows after that version, and clear what the stopped processes left; the version."""
    from services.report.resume import check_config, prepare_resume

    check_config(run_dir, settings)
    version = job_version(settings)
    where = (
        f"job {settings.job.name!r} in Redis; a run of `splitmq run` is resumed with "
        "`splitmq run --resume`"
    )
    prepare_resume(run_dir, version, settings.job.rounds, where)
    reset_for_resume(settings, client_ids)
    return version


def _keep_model(settings: Settings, run_dir: Path, *, since: float) -> None:
    """The model and schedule record in the run directory: the aggregator child keeps them
    when the job ends (`keep_job_model`); when it did not (it was killed, or never started),
    the job's last version from the store, now that every child has stopped."""
    from services.cli.role_cmds import keep_job_model
    from services.common.schedule_file import SCHEDULE_FILE
    from services.report.final_model import MODEL_FILE

    kept = [run_dir / MODEL_FILE, run_dir / SCHEDULE_FILE]
    if not all(p.is_file() and p.stat().st_mtime >= since for p in kept):
        keep_job_model(settings, run_dir, "splitmq up", "splitmq.runtime")
    _echo_model(run_dir)


def _echo_model(run_dir: Path) -> None:
    from services.report.final_model import MODEL_FILE, PERSONAL_DIR

    if (run_dir / MODEL_FILE).is_file():
        personal = len(list((run_dir / PERSONAL_DIR).glob("*.safetensors")))
        extra = f" (+ {personal} personal in {PERSONAL_DIR}/)" if personal else ""
        click.echo(f"  trained model            {run_dir / MODEL_FILE}{extra}")


def _report(run_dir: Path) -> tuple[str, str]:
    """The run's summary (summary.txt when the aggregator wrote it, else one rebuilt from
    metrics.json) and the status its report says."""
    from services.report.rundir import METRICS_JSON, SUMMARY_FILE, RunInfo
    from services.report.summary import summary_text

    try:
        doc = json.loads((run_dir / METRICS_JSON).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        doc = None
    status = "no report" if doc is None else str(doc.get("run", {}).get("status", "unknown"))
    if (run_dir / SUMMARY_FILE).is_file():
        return (run_dir / SUMMARY_FILE).read_text(encoding="utf-8"), status
    if doc is None:
        return f"no report in {run_dir} (the aggregator did not start)\n", status
    records = [record_from_dict(r) for r in doc["records"]]
    return summary_text(RunInfo(**doc["run"]), records, run_dir), status
