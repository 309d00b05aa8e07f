"""What every `splitmq` command shares: the group's options, the CONFIG argument, logging
options, signal handling, and the error boundary.

The boundary: a user's mistake (`services.common.user_errors`) is click's one-line "Error: ..."
and exit status 1, a bug keeps its traceback (docs/reliability.md, "Beyond the consumers").
Every command runs inside it, so no command catches errors just to print them.
"""

from __future__ import annotations

import functools
import os
import secrets
import shlex
import signal
import socket
import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any, TypeVar, cast

import click

from services.common.backends import Backends
from services.common.logs import ContextValue, configured_logging
from services.common.user_errors import user_message
from services.config.loading import ConfigError, load_settings
from services.config.root import Settings
from services.runtime.doctor import check_broker, check_store

if TYPE_CHECKING:
    from services.report.filesink import FileSink
    from services.report.records import MetricsSink

F = TypeVar("F", bound=Callable[..., Any])

CONFIG_ENV = "SPLITMQ_CONFIG"


@dataclass(frozen=True)
class GroupOptions:
    """What `splitmq [--config FILE] [--debug]` hands every subcommand."""

    config: Path | None = None
    debug: bool = False

    def settings(self, config: Path | None = None) -> Settings:
        """The settings of the command's CONFIG, else of --config, else defaults and the
        environment only (a healthcheck configured by SPLITMQ_* variables needs no file)."""
        return read_settings(config or self.config, os.environ)


def group_options(ctx: click.Context | None = None) -> GroupOptions:
    """What `splitmq [--config FILE] [--debug]` was given (`.debug`: tracebacks for all)."""
    ctx = ctx or click.get_current_context(silent=True)
    found = ctx.find_object(GroupOptions) if ctx is not None else None
    return found or GroupOptions()


class ErrorBoundary(click.Group):
    """A click group whose subcommands' user errors end as one line (`user_message`)."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except Exception as exc:  # click's own exceptions are no user_message: re-raised
            message = user_message(exc)
            if message is None or group_options(ctx).debug:
                raise
            raise click.ClickException(message) from None


# CONFIG: the job's TOML file; falls back to the group's --config, which falls back to
# SPLITMQ_CONFIG (so the command line wins over the environment).
config_argument = click.argument(
    "config", required=False, type=click.Path(dir_okay=False, path_type=Path)
)
report_dir_option = click.option(
    "--report-dir",
    type=click.Path(file_okay=False, path_type=Path),
    help="Where run directories go (default: report.dir from the config).",
)


@dataclass(frozen=True)
class LogOptions:
    """--log-json / --log-format and --log-level, as one value (`log_options`)."""

    json: bool = False
    level: str | None = None

    def logging(
        self, settings: Settings, context: Mapping[str, ContextValue], *, default: str | None = None
    ) -> AbstractContextManager[object]:
        """--log-level, else the config's log_level when it was set explicitly, else
        `default`; JSON lines when asked on the command line or by the log_format setting."""
        if self.level:
            level = self.level.upper()
        elif default is not None and "log_level" not in settings.model_fields_set:
            level = default
        else:
            level = settings.log_level
        json_lines = self.json or settings.log_format == "json"
        return configured_logging(
            level, json_lines=json_lines, context=context, debug=group_options().debug
        )


_log_format = click.option(
    "--log-format",
    type=click.Choice(["text", "json"]),
    help="text (default) or json: one object per line with job, client, shard and "
    "version (also the log_format setting, SPLITMQ_LOG_FORMAT).",
)
_log_level = click.option(
    "--log-level",
    type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"], case_sensitive=False),
    help="Log level (default: log_level from the config, INFO).",
)
_log_json = click.option("--log-json", is_flag=True, help="Same as --log-format json.")


def log_options(func: F) -> F:
    """--log-level, and the log format: --log-format json (or its older spelling --log-json);
    the command gets them as `log: LogOptions`."""

    @functools.wraps(func)
    def with_log(
        *args: Any, log_json: bool, log_level: str | None, log_format: str | None, **kwargs: Any
    ) -> Any:
        return func(*args, log=LogOptions(log_json or log_format == "json", log_level), **kwargs)

    return cast(F, _log_json(_log_level(_log_format(with_log))))


def require_servers(settings: Settings, command: str, *, store: bool = True) -> None:
    """A command in a process of its own needs the shared broker (and store), not the
    in-memory ones, which live inside one process."""
    if settings.broker.kind == "rabbitmq" and (not store or settings.store.kind == "redis"):
        return
    raise click.ClickException(
        f"`splitmq {command}` runs as its own process, so it needs a shared broker and store: "
        f'set broker.kind = "rabbitmq" and store.kind = "redis" in the config (or '
        f"SPLITMQ_BROKER=rabbitmq SPLITMQ_STORE=redis); got broker.kind = "
        f"{settings.broker.kind!r}, store.kind = {settings.store.kind!r}. `splitmq run` "
        f"runs every role in one process with the in-memory ones."
    )


def require_reachable(settings: Settings, command: str) -> None:
    """RabbitMQ and Redis must both answer (`splitmq up`, `splitmq clean`)."""
    backends = Backends(settings.broker, settings.store)
    failed = [c for c in (check_broker(backends), check_store(backends)) if not c.ok]
    if failed:
        problems = "\n  ".join(c.detail + (f" ({c.hint})" if c.hint else "") for c in failed)
        raise click.ClickException(f"splitmq {command} needs RabbitMQ and Redis:\n  {problems}")


def run_report(
    settings: Settings,
    report_dir: Path | None,
    run_dir: Path | None = None,
    *,
    resume: bool = False,
) -> tuple[FileSink, MetricsSink]:
    """The run directory's sink, and one that also prints a line per round; the banner and
    the run directory are printed first. `resume`: go on with the run in `run_dir`."""
    from services.report.filesink import FileSink
    from services.report.rundir import command_line
    from services.report.sinks import Continued, EchoSink, TeeSink
    from services.report.summary import banner
    from services.report.tracking import TrackingUnavailable, run_trackers

    if resume:
        if run_dir is None:
            raise ValueError("resuming needs the run directory to go on with")
        files = FileSink.resume(settings, run_dir, command=command_line())
    else:
        files = FileSink.create(
            settings, command=command_line(), base_dir=report_dir, run_dir=run_dir
        )
    click.echo(banner(files.info))
    click.echo(f"run directory: {files.run_dir}" + (" (resumed)" if resume else ""))
    try:
        trackers = run_trackers(settings, files.run_dir, resume=resume)
    except TrackingUnavailable as exc:
        raise click.ClickException(str(exc)) from None
    echo = EchoSink(click.echo, rounds=settings.job.rounds)
    return files, Continued(TeeSink([files, *trackers, echo]), files.elapsed_before_s)


def read_settings(path: Path | None, env: Mapping[str, str]) -> Settings:
    """The settings of `path` under `env`; a ConfigError keeps its lines (one per field)."""
    try:
        return load_settings(path, env)
    except ConfigError as exc:
        raise click.ClickException(str(exc)) from None


def load(config: Path | None) -> tuple[Path, Settings]:
    """The config path to use (CONFIG, else the group's --config) and its settings."""
    path = config or group_options().config
    if path is None:
        raise click.UsageError(
            f"no configuration: pass CONFIG (or `splitmq --config FILE ...`) or set {CONFIG_ENV}"
        )
    return path, read_settings(path, os.environ)


def comma_floats(text: str) -> list[float]:
    """Comma-separated numbers >= 0, as options give lists of them."""
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise click.BadParameter(f"expected comma-separated numbers, got {text!r}") from None
    if any(v < 0 for v in values):
        raise click.BadParameter(f"the numbers must be >= 0, got {text!r}")
    return values


def stated_command(ctx: click.Context, *head: str, skip: tuple[str, ...] = ()) -> str:
    """The command that reproduces this invocation: `splitmq NAME *head` and the options that
    differ from their defaults (`skip`: options left out).

    Built from the parsed options rather than argv (which is a test runner's under pytest).
    """
    args = ["splitmq", ctx.command.name or "", *head]
    for param in ctx.command.params:
        value = ctx.params[param.name or ""]
        if not isinstance(param, click.Option) or param.name in skip:
            continue
        # A flag's default reads as a sentinel, not False, in newer click: ask its value.
        if param.is_flag:
            args += [param.opts[0]] if value else []
        elif value is not None and value != param.default:
            args += [param.opts[0], str(value)]
    return shlex.join(args)


def default_member_id(prefix: str = "") -> str:
    """hostname-pid-random: readable in logs and queue names, and unique even where processes
    share both: containers on `network_mode: host` all carry the host's hostname, and each
    container's role runs under the same small pid (e.g. 7, behind `init: true`)."""
    host = socket.gethostname().split(".")[0] or "host"
    safe = "".join(c if c.isalnum() or c in "-_" else "-" for c in host)
    return f"{prefix}{safe}-{os.getpid()}-{secrets.token_hex(3)}"


@contextmanager
def stop_on_signals(stop: threading.Event | None = None) -> Iterator[threading.Event]:
    """SIGTERM and SIGINT set `stop` (a new event by default) for a graceful end; a second
    SIGINT interrupts hard.

    Handlers can only be installed from the main thread; elsewhere the event is only yielded.
    """
    stop = stop or threading.Event()
    if threading.current_thread() is not threading.main_thread():
        yield stop
        return

    def on_signal(signum: int, frame: FrameType | None) -> None:
        if signum == signal.SIGINT and stop.is_set():
            raise KeyboardInterrupt
        stop.set()

    saved = {signum: signal.signal(signum, on_signal) for signum in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield stop
    finally:
        for signum, handler in saved.items():
            signal.signal(signum, handler)
