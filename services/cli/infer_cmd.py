"""`splitmq infer CONFIG --sweep 0,0.1,0.5,1,2`: split inference of a SplitGP run, E_th sweep
(what it reads, whom it asks and what it prints: docs/algorithms.md, "Sweep of a service run").
"""

from __future__ import annotations

import csv
import logging
from collections.abc import Iterator
from contextlib import ExitStack, closing, contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import click

from broker.store import SERVER_PART, BlobRef, MemberKind
from services.cli.common import comma_floats, config_argument, load
from services.common.backends import Backends
from services.config.root import Settings
from services.security.identity import service_user

if TYPE_CHECKING:
    from services.client.inference import ServerLogits
    from services.client.inference_sweep import SweepRow

MEMORY_STORE = (
    "splitmq infer reads a run's weights from the store, and an embedded `splitmq run` keeps "
    "them in memory only: run the job with `splitmq up` (Redis keeps the last versions). A "
    "`splitmq run` reports the same sweep for every version in its metrics.json / metrics.csv "
    "(the splitgp.sweep.<E_th>.* columns)."
)

NO_WORKER = (
    "no worker is serving job {job!r} (none is live in the store; a finished job's workers "
    "have stopped): add --serve to answer the requests in this process, or --local"
)


@click.command()
@config_argument
@click.option(
    "--sweep",
    "sweep_text",
    default="0,0.1,0.25,0.5,1,2",
    show_default=True,
    help="Entropy thresholds E_th (nats), comma-separated.",
)
@click.option("--version", type=int, default=0, help="Weights version (0: newest).")
@click.option(
    "--clients",
    "max_clients",
    type=int,
    default=0,
    help="Sweep only the first N clients with personalised weights (0: all).",
)
@click.option(
    "--rows",
    type=int,
    default=1000,
    show_default=True,
    help="Test samples per client (0: the whole test split).",
)
@click.option(
    "--local",
    "in_process",
    is_flag=True,
    help="Run theta in this process instead of asking the workers.",
)
@click.option(
    "--serve",
    is_flag=True,
    help="Answer the InferRequests with an inference server in this process (for a "
    "job whose workers have stopped).",
)
@click.option(
    "--timeout",
    "timeout_s",
    type=float,
    default=30.0,
    show_default=True,
    help="Seconds to wait for the workers' answer to one request.",
)
@click.option(
    "--out",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Write the per-client rows to this CSV file.",
)
def infer(
    config: Path | None,
    sweep_text: str,
    version: int,
    max_clients: int,
    rows: int,
    in_process: bool,
    serve: bool,
    timeout_s: float,
    out: Path | None,
) -> None:
    """Split inference (SplitGP) of a run's weights: accuracy and offloaded fraction vs E_th."""
    from services.algorithms.registry import build_strategy
    from services.client.data import JobData
    from services.client.inference_sweep import personal_clients, sweep_clients

    thresholds = comma_floats(sweep_text)
    if not thresholds:
        raise click.BadParameter("give one or more thresholds", param_hint="--sweep")
    _, settings = load(config)
    strategy = build_strategy(settings.algorithm.name, settings.algorithm.params())
    if strategy.server is None or not strategy.server.split_inference:
        raise click.ClickException(
            f"algorithm {settings.algorithm.name!r} has no split inference (SplitGP has)"
        )
    if settings.store.kind == "memory":
        raise click.ClickException(MEMORY_STORE)
    backends = Backends(settings.broker, settings.store)
    with closing(backends.open_store()) as store:
        job = settings.job.name
        version = version or store.current_version(job)
        if version == 0:
            raise click.ClickException(f"job {job!r} has no published version in the store")
        clients = personal_clients(store, job, version)[: max_clients or None]
        if not clients:
            raise click.ClickException(f"version {version} of {job!r} has no personalised clients")
        if not (serve or in_process) and not store.live_members(job, MemberKind.WORKER):
            # A finished job's workers are gone: its requests would only time out.
            raise click.ClickException(NO_WORKER.format(job=job))
        click.echo(f"job {job} version {version}: {len(clients)} clients, E_th {thresholds}")
        source = theta_source(
            settings, backends, version, in_process=in_process, serve=serve, timeout_s=timeout_s
        )
        with source as theta:
            results = sweep_clients(
                settings,
                store,
                JobData(settings),
                theta,
                version=version,
                thresholds=thresholds,
                clients=clients,
                rows=rows,
            )
    click.echo(table(results))
    if out is not None:
        write_csv(out, results)
        click.echo(f"per-client rows: {out}")


@contextmanager
def theta_source(
    settings: Settings,
    backends: Backends,
    version: int,
    *,
    in_process: bool,
    serve: bool,
    timeout_s: float,
) -> Iterator[ServerLogits]:
    """Where theta's logits come from for the sweep: this process (`--local`), else the
    job's workers through the broker, answered by an inference server started here when
    `serve`; stopped afterwards."""
    from models.parts import ServerModel
    from models.state import load_partial
    from services.client.inference import BrokerTheta, LocalTheta
    from services.common.jobmodel import job_model
    from services.runtime.plugins import inference_factory

    if in_process:
        theta = ServerModel(job_model(settings), settings.model.cut)
        with closing(backends.open_store()) as store:
            load_partial(theta, store.read_blob(settings.job.name, version, BlobRef(SERVER_PART)))
        yield LocalTheta(theta)
        return
    with ExitStack() as stack:  # the broker handle closed first, then the server stopped
        if serve:
            stop_server = inference_factory().start_inference(
                settings,
                backends,
                worker_id="splitmq-infer",
                logger=logging.getLogger("splitmq.infer"),
            )
            stack.callback(stop_server)
        # In the secured mode its requests carry the services' AMQP user (workers check it).
        broker = backends.open_broker("splitmq-infer-client", stamp=service_user(settings))
        stack.callback(broker.close)
        yield BrokerTheta(broker, settings.job.name, version=version, timeout_s=timeout_s)


def table(results: list[SweepRow]) -> str:
    from services.client.inference_sweep import mean_rows

    lines = [f"{'E_th':>6}  {'set':<6}  {'accuracy':>8}  {'offloaded':>9}  clients"]
    for threshold, rows_set, accuracy, offloaded, clients in mean_rows(results):
        lines.append(
            f"{threshold:>6g}  {rows_set:<6}  {accuracy:>8.1%}  {offloaded:>9.1%}  {clients:>7}"
        )
    return "\n".join(lines)


def write_csv(path: Path, results: list[SweepRow]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(["client", "set", "threshold", "accuracy", "offloaded", "rows"])
        for r in results:
            writer.writerow([r.client, r.rows_set, r.threshold, r.accuracy, r.offloaded, r.rows])
