"""What every `splitmq` command shares: the CONFIG argument, logging options, signal handling."""

from __future__ import annotations

import functools
import os
import secrets
import signal
import socket
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from typing import Any, TypeVar, cast

import click

from services.config.loading import ConfigError, load_settings
from services.config.root import Settings

F = TypeVar("F", bound=Callable[..., Any])

CONFIG_ENV = "SPLITMQ_CONFIG"


def config_argument(func: F) -> F:
    """CONFIG: the job's TOML file; falls back to SPLITMQ_CONFIG, then the global --config."""
    decorator = click.argument(
        "config",
        required=False,
        envvar=CONFIG_ENV,
        type=click.Path(dir_okay=False, path_type=Path),
    )
    return decorator(func)


def log_options(func: F) -> F:
    """--log-level, and the log format: --log-format json (or its older spelling --log-json)."""

    command = func

    @functools.wraps(command)
    def with_format(*args: Any, log_format: str | None = None, **kwargs: Any) -> Any:
        if log_format == "json":
            kwargs["log_json"] = True
        return command(*args, **kwargs)

    func = cast(F, with_format)
    func = click.option(
        "--log-format",
        type=click.Choice(["text", "json"]),
        default=None,
        help="text (default) or json: one object per line with job, client, shard and "
        "version (also the log_format setting, SPLITMQ_LOG_FORMAT).",
    )(func)
    func = click.option(
        "--log-level",
        type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"], case_sensitive=False),
        default=None,
        help="Log level (default: log_level from the config, INFO).",
    )(func)
    return click.option(
        "--log-json",
        is_flag=True,
        help="Same as --log-format json.",
    )(func)


def json_logs(settings: Settings, log_json: bool) -> bool:
    """JSON lines when asked on the command line or by the log_format setting."""
    return log_json or settings.log_format == "json"


def resolve_config(config: Path | None) -> Path:
    """The config path to use; a clear error when none was given."""
    if config is None:
        group = click.get_current_context().find_root().obj
        config = getattr(group, "config", None)
    if config is None:
        raise click.UsageError(f"no configuration: pass CONFIG or set {CONFIG_ENV}")
    return config


def load(config: Path | None) -> tuple[Path, Settings]:
    path = resolve_config(config)
    try:
        return path, load_settings(path, os.environ)
    except ConfigError as exc:
        raise click.ClickException(str(exc)) from None


def pick_log_level(settings: Settings, override: str | None, default: str | None = None) -> str:
    """--log-level, else the config's log_level when it was set explicitly, else `default`."""
    if override:
        return override.upper()
    if default is not None and "log_level" not in settings.model_fields_set:
        return default
    return settings.log_level


def default_member_id(prefix: str = "") -> str:
    """hostname-pid-random: readable in logs and queue names, and unique even where processes
    share both: containers on `network_mode: host` all carry the host's hostname, and each
    container's role runs under the same small pid (e.g. 7, behind `init: true`)."""
    host = socket.gethostname().split(".")[0] or "host"
    safe = "".join(c if c.isalnum() or c in "-_" else "-" for c in host)
    return f"{prefix}{safe}-{os.getpid()}-{secrets.token_hex(3)}"


@contextmanager
def stop_on_signals(stop: threading.Event, *, sigint: bool = True) -> Iterator[None]:
    """SIGTERM (and SIGINT) set `stop` for a graceful end; a second SIGINT interrupts hard.

    Handlers can only be installed from the main thread; elsewhere this does nothing.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_term(signum: int, frame: FrameType | None) -> None:
        stop.set()

    def on_int(signum: int, frame: FrameType | None) -> None:
        if stop.is_set():
            raise KeyboardInterrupt
        stop.set()

    saved = {signal.SIGTERM: signal.signal(signal.SIGTERM, on_term)}
    if sigint:
        saved[signal.SIGINT] = signal.signal(signal.SIGINT, on_int)
    try:
        yield
    finally:
        for signum, handler in saved.items():
            signal.signal(signum, handler)
