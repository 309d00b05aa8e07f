"""`splitmq clean CONFIG`: delete what a job leaves on RabbitMQ and Redis after it ends."""

from __future__ import annotations

import os
from pathlib import Path

import click

from services.cli.common import config_argument, load, read_settings, require_reachable


@click.command()
@config_argument
@click.option(
    "--client",
    "client_ids",
    multiple=True,
    help="Also the reply queues of this client id (repeatable): clients started by hand with "
    "their own --id.",
)
@click.option("--force", is_flag=True, help="Clean even while the job seems to be running.")
def clean(config: Path | None, client_ids: tuple[str, ...], force: bool) -> None:
    """Delete a job's queues and store keys (CONFIG names the job and the servers).

    Removes the job's server-side queues (control, updates, shards, infer, dead letters), the
    reply queues of client-0 ... client-N-1 (the ids `splitmq up` gives, N = clients.count),
    of the clients the store still lists and of every --client, and every splitmq:<job>:* key
    in Redis (versions, checkpoints, members, the job's status). Refuses while members of the
    job are live and it has not ended, unless --force: a running job would lose its messages
    and weights.
    """
    from contextlib import closing

    from broker.keys import CLIENT_MEMBER_PREFIX
    from broker.store import MemberKind
    from services.common.backends import Backends
    from services.runtime.processes import clear_job

    path, _ = load(config)
    # The servers `splitmq up` runs the job on, whatever kinds the file names.
    env = {**os.environ, "SPLITMQ_BROKER": "rabbitmq", "SPLITMQ_STORE": "redis"}
    settings = read_settings(path, env)
    require_reachable(settings, "clean")
    job = settings.job.name
    with closing(Backends(settings.broker, settings.store).open_store(give_up_after=10.0)) as store:
        ended = store.job_status(job) is not None
        live_clients = store.live_members(job, MemberKind.CLIENT)
        members = [*live_clients, *store.live_members(job, MemberKind.WORKER)]
    live = sorted(m.split(":", 1)[-1] for m in members)  # ids without the kind's prefix
    if live and not ended and not force:
        raise click.ClickException(
            f"job {job!r} has not ended and has {len(live)} live member(s) "
            f"({', '.join(live[:5])}): stop the run first, or pass --force"
        )
    clients = {f"client-{i}" for i in range(settings.clients.count)}
    clients |= {m.removeprefix(CLIENT_MEMBER_PREFIX) for m in live_clients} | set(client_ids)
    clear_job(settings, sorted(clients))
    click.echo(
        f"cleaned job {job}: its queues, the reply queues of {len(clients)} client(s) and its "
        "store keys"
    )
