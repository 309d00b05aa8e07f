"""`splitmq provision-clients CONFIG --count N [--hosts H1,H2]`: one RabbitMQ user per client
and per client host of the job (secured mode)."""

from __future__ import annotations

from pathlib import Path

import click

from broker.errors import BrokerError
from services.cli.common import config_argument, load
from services.common.backends import Backends
from services.security.admin import AdminError, pick_admin
from services.security.identity import client_user, host_user
from services.security.provision import client_names, host_names, provision, revoke, vhost_of


@click.command("provision-clients")
@config_argument
@click.option("--count", type=click.IntRange(min=0), default=0, help="How many clients.")
@click.option(
    "--hosts",
    "hosts_text",
    default="",
    help="Client hosts (`splitmq clients`), comma-separated: a user <job>.host.<H> each, who "
    "reads only the host's queue, where the replies of its clients <H>-<n> arrive.",
)
@click.option("--prefix", default="client-", show_default=True, help="Client ids: PREFIX0, ...")
@click.option("--start", type=click.IntRange(min=0), default=0, help="First client number.")
@click.option(
    "--out",
    "out_dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=Path("secrets/clients"),
    show_default=True,
    help="Where each client's env file (<job>.<id>.env, mode 600) goes (a host's: "
    "<job>.host.<H>.env).",
)
@click.option(
    "--admin",
    "admin_kind",
    type=click.Choice(["auto", "http", "rabbitmqctl"]),
    default="auto",
    show_default=True,
    help="How to manage users: the management HTTP API (with the config's AMQP credentials, "
    "which need the administrator tag), rabbitmqctl on this host, or whichever works.",
)
@click.option("--management-url", help="Default: http(s)://<AMQP host>:15672.")
@click.option(
    "--client-url",
    help="The AMQP URL clients connect to (default: the config's broker.amqp_url); "
    "its credentials are replaced by each client's.",
)
@click.option(
    "--revoke",
    "revoke_users",
    is_flag=True,
    help="Delete these users (of this job only) and their reply queues (hosts: their host "
    "queues) instead.",
)
@click.option(
    "--force",
    is_flag=True,
    help="Reset users of this job that exist already (new passwords: clients holding the old "
    "ones are locked out); without it they are refused.",
)
def provision_clients(
    config: Path | None,
    count: int,
    hosts_text: str,
    prefix: str,
    start: int,
    out_dir: Path,
    admin_kind: str,
    management_url: str | None,
    client_url: str | None,
    revoke_users: bool,
    force: bool,
) -> None:
    """Create a RabbitMQ user for each of COUNT clients (the secured mode, design §3).

    Client <id> of job <job> logs in as user <job>.<id>, so jobs sharing a broker and a
    prefix never touch each other's users; existing users are refused without --force. Each
    may publish to the smashed and control exchanges with its own AMQP user_id and its own
    job's routing keys only (RabbitMQ topic permissions), and read only its own reply queues
    (training and split inference, named with a part derived from its password, so that no
    other client can find them); its credentials go to
    OUT/<job>.<id>.env, to be set in the client's environment (they also turn
    security.per_client_users on there). Run the services with
    security.per_client_users = true, and the clients with `--id <id>`.

    With --hosts, each client host H gets user <job>.host.<H>, which may read only H's queue
    (<job>.host.<H>.<a part derived from its password>, which its clients' Joins name); the
    coordinator routes there the replies of H's clients <H>-<n> only.
    Client ids of that shape are refused beside a host H (H could speak for them).
    """
    _, settings = load(config)
    if settings.broker.kind != "rabbitmq":
        raise click.ClickException('per-client users need broker.kind = "rabbitmq"')
    job = settings.job.name
    try:
        names = client_names(prefix, count, start)
        hosts = host_names(hosts_text)
        if not names and not hosts:
            raise ValueError("nothing to provision: give --count N, --hosts H1,H2, or both")
        admin = pick_admin(admin_kind, settings.broker.amqp_url, management_url)
    except (ValueError, AdminError) as exc:
        raise click.ClickException(str(exc)) from None
    broker = Backends(settings.broker, settings.store).open_broker("splitmq-provision")
    try:
        if revoke_users:
            vhost = vhost_of(settings.broker.amqp_url)
            revoke(admin, broker, job=job, clients=names, hosts=hosts, vhost=vhost)
            users = [client_user(job, n) for n in names] + [host_user(job, h) for h in hosts]
            click.echo(
                f"job {job}: deleted {len(users)} users with {admin.name} and their reply "
                f"queues: {', '.join(users)}"
            )
            return
        written = provision(
            admin,
            broker,
            job=job,
            clients=names,
            vhost=vhost_of(settings.broker.amqp_url),
            url_template=client_url or settings.broker.amqp_url,
            out_dir=out_dir,
            force=force,
            hosts=hosts,
        )
    except (AdminError, BrokerError) as exc:
        raise click.ClickException(str(exc)) from None
    finally:
        broker.close()
    click.echo(f"job {job}: {len(written)} users provisioned with {admin.name}")
    for creds in written:
        click.echo(f"  {creds.name} (user {creds.user}): {creds.path}")
    click.echo(
        "clients: set a file's variables, then `splitmq client CONFIG --id <id>` (a host: "
        "`splitmq clients CONFIG --host <H>`); services: set security.per_client_users = true"
    )
