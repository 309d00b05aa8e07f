"""Probes of the configured servers: `splitmq doctor` (is the broker and store usable, and if
not, what to do) and a role's first contact with them (`check_services`).

A role process waits out a brief outage at start (RabbitMQ or Redis restarting beside it), but
not the whole outage budget of a running role (`reconnect_give_up_s`, 300 s by default): a
wrong port or host should fail within `START_WAIT_S`, and a refused password or a bad URL at
once, each in one line. A signal ends the wait (a running role's reconnects know nothing of
the stop event, so without this SIGTERM went unheard for the whole budget).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping, Sequence
from contextlib import closing
from dataclasses import dataclass, replace

from broker.errors import (
    BrokerAuthError,
    ConnectionSettingsError,
    SplitMQError,
    StoreAuthError,
)
from broker.redis_store import RedisWeightStore
from services.common.backends import Backends, Embedded
from services.config.root import Settings
from services.data.errors import DataError
from services.data.registry import DATASETS, DatasetSpec
from services.report.tomlwrite import redact_url


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    detail: str
    hint: str = ""
    warning: bool = False  # ok, but worth a look


def check_broker(backends: Backends) -> Check:
    settings = backends.broker_settings
    if settings.kind == "rabbitmq" and len(settings.urls) > 1:
        return _check_nodes(backends)
    where = redact_url(settings.amqp_url) if settings.kind == "rabbitmq" else "in this process"
    try:
        broker = backends.open_broker("splitmq-doctor", give_up_after=5.0)
    except BrokerAuthError as exc:
        return Check(
            "broker",
            False,
            str(exc),  # names the URL (no password) and whether the login or the vhost failed
            "fix the user and password (or vhost) in SPLITMQ_AMQP_URL / broker.amqp_url; "
            "`rabbitmqctl authenticate_user USER PASSWORD` checks a password, "
            "`rabbitmqctl list_permissions -p VHOST` who may use the vhost",
        )
    except ConnectionSettingsError as exc:
        return Check("broker", False, str(exc), "fix SPLITMQ_AMQP_URL / broker.amqp_url")
    except SplitMQError as exc:
        return Check(
            "broker",
            False,
            f"cannot reach RabbitMQ at {where}: {exc}",
            "start it (`rabbitmq-server -detached`) or set SPLITMQ_AMQP_URL",
        )
    try:
        info = broker.server_info()
    except SplitMQError as exc:
        return Check("broker", False, f"{where}: {exc}")
    finally:
        broker.close()
    detail = (
        f"{info.product} {info.version} {where}; declare "
        f"{'ok' if info.can_declare else 'REFUSED'}, publish "
        f"{'ok' if info.can_publish else 'REFUSED'}, max message "
        f"{info.max_message_bytes / 2**20:.0f} MiB"
    )
    ok = info.can_declare and info.can_publish
    hint = ""
    if not ok:
        hint = info.detail or "grant the user configure/write/read permissions on the vhost"
    return Check("broker", ok, detail, hint)


def _check_nodes(backends: Backends) -> Check:
    """A cluster, node by node: usable while one node is, worth a warning while any is down
    (its quorum queues have one replica fewer; two down of three and they stop)."""
    settings = backends.broker_settings
    checks = [
        check_broker(
            replace(
                backends,
                broker_settings=settings.model_copy(update={"amqp_url": url, "amqp_urls": (url,)}),
            )
        )
        for url in settings.urls
    ]
    up = sum(check.ok for check in checks)
    kind = "quorum" if settings.quorum else "classic"
    detail = f"{up} of {len(checks)} nodes up, {kind} queues: " + "; ".join(
        f"[{'ok' if check.ok else 'DOWN'}] {check.detail}" for check in checks
    )
    hints = [check.hint for check in checks if not check.ok and check.hint]
    return Check(
        "broker", up > 0, detail, "; ".join(dict.fromkeys(hints)), warning=0 < up < len(checks)
    )


def check_store(backends: Backends) -> Check:
    settings = backends.store_settings
    if settings.kind == "memory":
        return Check("store", True, "in-memory weight store in this process")
    where = redact_url(settings.redis_url)
    hint = "start it (`redis-server --daemonize yes`) or set SPLITMQ_REDIS_URL"
    if settings.sentinels:
        where = f"Sentinel master {settings.master_name!r} via {', '.join(settings.sentinels)}"
        hint = (
            "check the sentinels (store.sentinels, SPLITMQ_REDIS_SENTINELS) and that they name "
            "a primary: `redis-cli -p PORT sentinel get-master-addr-by-name "
            f"{settings.master_name}`"
        )
    try:
        store = backends.open_store(wait=False)
        assert isinstance(store, RedisWeightStore)
        info = store.server_info()
    except StoreAuthError as exc:
        return Check(
            "store",
            False,
            f"Redis at {where}: {exc}",
            "fix the password (and user) in SPLITMQ_REDIS_URL / store.redis_url",
        )
    except ConnectionSettingsError as exc:
        return Check("store", False, str(exc), "fix SPLITMQ_REDIS_URL / store.redis_url")
    except SplitMQError as exc:
        return Check("store", False, f"cannot use Redis at {where}: {exc}", hint)
    finally:
        if "store" in locals():
            store.close()
    ok = info.can_write and info.can_read
    if settings.sentinels:
        where = f"primary {info.primary} (Sentinel master {settings.master_name!r})"
    detail = (
        f"Redis {info.version} at {where}; write {'ok' if info.can_write else 'REFUSED'}, "
        f"read {'ok' if info.can_read else 'REFUSED'}, "
        + (f"AOF on (appendfsync {info.aof_fsync})" if info.aof_enabled else "AOF off")
    )
    if settings.sentinels or info.replicas:
        detail += f"; replicas: {', '.join(info.replicas) or 'none'}"
    if info.sentinels:
        detail += f"; sentinels: {', '.join(info.sentinels)}"
    return Check("store", ok, detail, "; ".join(info.problems), warning=ok and bool(info.problems))


def check_data(settings: Settings, env: Mapping[str, str]) -> Check:
    # torch (via the loaders) is imported by the checks that need it, not by this module:
    # `splitmq check` uses check_broker and check_store as a frequent container healthcheck.
    from services.common.jobdata import data_request
    from services.data.loaders import find_source, input_shape, resolve_data_dir

    request = data_request(settings)
    try:
        source = find_source(request.dataset)
        if isinstance(source, DatasetSpec):
            path = resolve_data_dir(source, request.dir or None, env)
            return Check("data", True, f"{source.name} in {path}")
        shape = input_shape(request, env)
    except DataError as exc:
        fix = (
            "set [data] dir or SPLITMQ_DATA_DIR"
            if request.dataset in DATASETS
            else ("check [data] dataset and path (docs/data.md)")
        )
        return Check("data", False, str(exc), fix)
    where = f" from {request.resolve(request.path)}" if request.path else ""
    return Check("data", True, f"{request.dataset}{where}: samples {list(shape)}")


def check_torch() -> Check:
    import torch

    cuda = torch.cuda.is_available()
    device = torch.cuda.get_device_name(0) if cuda else "CPU only"
    return Check("torch", True, f"torch {torch.__version__}, {device}")


def _count(n: int, what: str) -> str:
    return f"{n} {what}{'' if n == 1 else 's'}"


def verdict(checks: Sequence[Check]) -> str:
    """The last line: what failed, else whether it passed clean or with warnings."""
    failed = sum(not check.ok for check in checks)
    warned = sum(check.ok and check.warning for check in checks)
    if failed:
        text = f"{_count(failed, 'check')} of {len(checks)} failed"
        return text + (f", {_count(warned, 'warning')}" if warned else "") + " (see above)"
    return f"passed with {_count(warned, 'warning')} (see above)" if warned else "all checks passed"


def run_checks(settings: Settings, env: Mapping[str, str] | None = None) -> list[Check]:
    env = os.environ if env is None else env
    backends = Backends(settings.broker, settings.store, Embedded())
    return [check_torch(), check_broker(backends), check_store(backends), check_data(settings, env)]


# Long enough for a broker or Redis restarting beside the role; compose starts roles only
# once both are healthy and restarts a role that failed, so a longer wait buys nothing.
START_WAIT_S = 30.0


class StartInterrupted(Exception):
    """A signal (the stop event) arrived while waiting for the broker or store."""


def check_services(
    backends: Backends,
    job: str,
    *,
    store: bool,
    stop: threading.Event,
    wait_s: float = START_WAIT_S,
) -> None:
    """Connect to the broker (and, if `store`, read `job`'s version from the store) once,
    waiting at most `wait_s` for each; raise what the broker layer raises
    (`BrokerUnavailableError`, `BrokerAuthError`, `ConnectionSettingsError`, their store
    twins) or `StartInterrupted`."""

    def sleep(seconds: float) -> None:
        if stop.wait(seconds):
            raise StartInterrupted

    broker_wait = min(wait_s, backends.broker_settings.reconnect_give_up_s)
    backends.open_broker("", give_up_after=broker_wait, sleep=sleep).close()
    if not store:
        return
    give_up_after = min(wait_s, backends.store_settings.retry_for_s)
    with closing(backends.open_store(give_up_after=give_up_after, sleep=sleep)) as probe:
        probe.current_version(job)
