"""`splitmq check ROLE`: a container healthcheck, exit code 0 healthy, 1 not, one line why;
`splitmq doctor`: every check of the configured services at once, with what to do. Which
health record counts (this host's by default, `--id`, `--anywhere`): docs/deployment.md,
"Health checks".
"""

from __future__ import annotations

import socket
from contextlib import closing
from pathlib import Path

import click

from broker.errors import SplitMQError
from services.cli.common import GroupOptions, config_argument
from services.common.backends import Backends
from services.common.health import Verdict, assess, assess_files
from services.config.root import Settings
from services.runtime.doctor import check_broker, check_store, run_checks, verdict

ROLES = ("coordinator", "aggregator", "worker", "autoscaler", "client")
PROBED = ("broker", "store")


def check_role(settings: Settings, role: str, *, instance: str | None, host: str | None) -> Verdict:
    backends = Backends(settings.broker, settings.store)
    if role in PROBED and getattr(settings, role).kind == "memory":
        return Verdict(False, f"{role}.kind is memory: it lives inside one process, none to check")
    if role in PROBED:
        result = (check_broker if role == "broker" else check_store)(backends)
        return Verdict(result.ok, result.detail)
    if role == "client":
        # Edge clients never touch Redis (design §3): their health is a file on their machine.
        return assess_files(settings.job.name, role, instance=instance)
    if settings.store.kind != "redis":
        where = 'set store.kind = "redis" (SPLITMQ_STORE=redis)'
        return Verdict(
            False, f"a {role} outside this process can only be seen in a shared store: {where}"
        )
    job = settings.job.name
    try:
        # Report an outage, don't sit through it.
        with closing(backends.open_store(wait=False)) as store:
            members = store.live_members(job)
    except SplitMQError as exc:
        return Verdict(False, f"store unreachable, cannot see the {role}: {exc}")
    return assess(members, role, job=job, host=host, instance=instance)


@click.command()
@click.argument("role", type=click.Choice([*ROLES, *PROBED]))
@config_argument
@click.option("--id", "instance", help="Check this instance (its id).")
@click.option("--anywhere", is_flag=True, help="Any live instance, not only one on this host.")
@click.pass_obj
def check(
    group: GroupOptions, role: str, config: Path | None, instance: str | None, anywhere: bool
) -> None:
    """Exit 0 if ROLE is healthy, 1 if not, with the reason on one line.

    CONFIG is the job's TOML file (or SPLITMQ_CONFIG, or `splitmq --config FILE check ...`);
    without one, the defaults and SPLITMQ_* variables.

    ROLE is a role (coordinator, aggregator, worker, autoscaler: is its health key live in
    the store?
    client: is its health file on this machine fresh?) or a service (broker, store: does it
    answer?). Made for container healthchecks:

    \b
      splitmq check worker job.toml
    """
    host = None if anywhere or instance else socket.gethostname()
    verdict = check_role(group.settings(config), role, instance=instance, host=host)
    click.echo(f"{'healthy' if verdict.ok else 'unhealthy'}: {verdict.reason}")
    if not verdict.ok:
        raise click.exceptions.Exit(1)


@click.command()
@config_argument
@click.pass_obj
def doctor(group: GroupOptions, config: Path | None) -> None:
    """Check the broker, store, data and torch that CONFIG configures.

    CONFIG is the job's TOML file (or SPLITMQ_CONFIG, or `splitmq --config FILE doctor`);
    without one, the defaults and SPLITMQ_* variables. Says in plain words what is wrong
    and how to fix it; exits 1 if a check failed.

    \b
      splitmq doctor examples/service.toml
    """
    results = run_checks(group.settings(config))
    for result in results:
        mark = "ok  " if result.ok and not result.warning else ("warn" if result.ok else "FAIL")
        click.echo(f"[{mark}] {result.name:<7} {result.detail}")
        if result.hint:
            click.echo(f"       {' ' * 7} -> {result.hint}")
    if not all(result.ok for result in results):
        raise click.ClickException(verdict(results))
    click.echo(verdict(results))
