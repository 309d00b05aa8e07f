"""`splitmq`: one console command, one subcommand per role."""

from __future__ import annotations

from pathlib import Path

import click

from services.cli.check_cmd import check, doctor
from services.cli.clean_cmd import clean
from services.cli.common import CONFIG_ENV, ErrorBoundary, GroupOptions
from services.cli.dashboard_cmd import dashboard
from services.cli.experiment_cmd import experiment
from services.cli.export_cmd import export
from services.cli.infer_cmd import infer
from services.cli.privacy_cmd import privacy
from services.cli.provision_cmd import provision_clients
from services.cli.replay_cmd import replay
from services.cli.role_cmds import aggregator, autoscale, client, clients, coordinator, worker
from services.cli.run_cmd import run, up
from services.cli.traces_cmd import traces


@click.group(cls=ErrorBoundary, context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "-c",
    "--config",
    # Not exists=True: a missing file reads the same as a missing CONFIG argument.
    type=click.Path(dir_okay=False, path_type=Path),
    envvar=CONFIG_ENV,
    help="TOML configuration file for any command, in place of its CONFIG argument "
    "(environment variables SPLITMQ_* override it).",
)
@click.option(
    "--debug",
    is_flag=True,
    envvar="SPLITMQ_DEBUG",
    help="Tracebacks for every error (by default a wrong setting, an unreachable server or a "
    "refused password is one line); SPLITMQ_DEBUG=1 reaches the roles `splitmq up` starts.",
)
@click.version_option(package_name="splitmq")
@click.pass_context
def cli(ctx: click.Context, config: Path | None, debug: bool) -> None:
    """SplitMQ: asynchronous split learning over RabbitMQ and Redis.

    \b
    Try it:   splitmq run examples/quickstart.toml
    Services: splitmq up examples/service.toml   (needs RabbitMQ and Redis)

    Each command takes the job's TOML file as its CONFIG argument (`splitmq doctor
    job.toml`); `splitmq --config job.toml doctor` does the same, and SPLITMQ_CONFIG
    where neither is given. SPLITMQ_* environment variables override the file.
    """
    ctx.obj = GroupOptions(config, debug)


for command in (run, up, coordinator, aggregator, worker, client, clients, check, doctor, clean):
    cli.add_command(command)
for command in (
    autoscale,
    dashboard,
    experiment,
    export,
    infer,
    privacy,
    provision_clients,
    replay,
):
    cli.add_command(command)
cli.add_command(traces)


def main() -> None:
    cli(prog_name="splitmq")


if __name__ == "__main__":
    main()
