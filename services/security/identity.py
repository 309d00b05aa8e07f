"""Who may send what: client ids, the AMQP user a message came from, stamping our own.

RabbitMQ validates the `user_id` property against the publishing connection's user, so a
delivery's `user_id`, when present, is the broker's word for who sent it; each consumer holds
a message to it through a `SenderCheck` (the rules per consumer and mode: docs/deployment.md,
"Two modes"). Client ids also become parts of queue names, routing keys (at most 255 bytes) and
store keys, so every service refuses a client field that is not a plain id.

A client's RabbitMQ user is `<job>.<client>`: neither ids nor job names hold a '.', so the name
says both unambiguously; every comparison of a `user_id` with a client id goes through
`client_user` / `user_client`.

A client host H (docs/architecture.md, "Client hosts") runs the clients `H-<n>` and logs in as
`<job>.host.<H>` (`host_user`), which is no client's user (a client id has no '.'). It may speak
for its own clients only: `client_host` says whose a client id is, by its shape alone, so a
standalone client must not take an id `H-<n>` of a host that exists (provisioning refuses).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from urllib.parse import unquote, urlparse

from broker.transport import Delivery
from services.config.root import Settings
from services.config.settings import ConnectionSettings

# The rule `services.client.Client` applies to its own id.
CLIENT_ID = re.compile(r"[A-Za-z0-9_-]{1,64}\Z")
DEFAULT_AMQP_USER = "guest"  # pika's default credentials when the URL names none
_JOB_SEPARATOR = "."  # in neither a job name nor a client id
# Longest host id: its clients' ids (`<host>-<index>`) must stay client ids.
HOST_ID_MAX = 48
_HOSTED = re.compile(r"(.+)-(0|[1-9][0-9]*)\Z")  # the last '-' splits: indices have none


def client_id_problem(client: str) -> str | None:
    """Why `client` cannot be a client id (None when it can)."""
    if CLIENT_ID.match(client):
        return None
    return f"client id {client[:80]!r} is not 1-64 letters, digits, '_' or '-'"


def client_user(job: str, client: str) -> str:
    """The RabbitMQ user of client `client` of job `job` in the secured mode."""
    return f"{job}{_JOB_SEPARATOR}{client}"


def user_client(job: str, user: str) -> str | None:
    """The client of `job` that RabbitMQ user `user` is (None: no client of that job)."""
    prefix = f"{job}{_JOB_SEPARATOR}"
    if not user.startswith(prefix):
        return None
    client = user[len(prefix) :]
    return client if client_id_problem(client) is None else None


def host_id_problem(host: str) -> str | None:
    """Why `host` cannot be a client host's id (None when it can)."""
    if CLIENT_ID.match(host) and len(host) <= HOST_ID_MAX:
        return None
    return f"host id {host[:80]!r} is not 1-{HOST_ID_MAX} letters, digits, '_' or '-'"


def client_host(client: str) -> str | None:
    """The host whose client `client` is (`H-<n>`, n a decimal index without leading zeros),
    None when it has no such shape."""
    shape = _HOSTED.match(client)
    if shape is None or host_id_problem(shape[1]) is not None:
        return None
    return shape[1]


def host_user(job: str, host: str) -> str:
    """The RabbitMQ user of client host `host` of job `job` in the secured mode."""
    return f"{job}{_JOB_SEPARATOR}host{_JOB_SEPARATOR}{host}"


def user_host(job: str, user: str) -> str | None:
    """The client host of `job` that RabbitMQ user `user` is (None: no host of that job)."""
    prefix = host_user(job, "")
    if not user.startswith(prefix):
        return None
    host = user[len(prefix) :]
    return host if host_id_problem(host) is None else None


def amqp_user(url: str) -> str:
    """The user an AMQP URL logs in as."""
    name = urlparse(url).username
    return unquote(name) if name else DEFAULT_AMQP_USER


@dataclass(frozen=True)
class SenderCheck:
    """How one consumer judges the `user_id` of what it receives."""

    secured: bool = False
    services: frozenset[str] = frozenset()
    job: str = ""  # whose clients' users (`client_user`) may send

    def client_problem(self, delivery: Delivery, client: str) -> str | None:
        """Why a client's message may not claim to come from `client` (None: it may): the
        sender must be the client's user, or the user of the host whose client it is."""
        user = delivery.user_id or ""
        host = user_host(self.job, user)
        mine = user == client_user(self.job, client) or (
            host is not None and client_host(client) == host
        )
        return self._problem(delivery, mine, f"client {client!r}")

    def host_problem(self, delivery: Delivery, host: str) -> str | None:
        """Why a message of a client host (a HostHeartbeat) may not claim to come from `host`."""
        return self._problem(
            delivery, delivery.user_id == host_user(self.job, host), f"host {host!r}"
        )

    def _problem(self, delivery: Delivery, theirs: bool, sender: str) -> str | None:
        """`theirs`: whether the delivery's user may speak for `sender`, when it has one."""
        user = delivery.user_id
        if user:
            return None if theirs else f"{sender} does not match the AMQP user {user!r}"
        if self.secured:
            return (
                f"no AMQP user_id on a message of {sender}: the secured mode "
                "(security.per_client_users) requires one"
            )
        return None

    def service_problem(self, delivery: Delivery, what: str) -> str | None:
        """Why `what` (a service's message) may not come from this delivery's sender."""
        if not self.secured or delivery.user_id in self.services:
            return None
        return (
            f"{what} from AMQP user {delivery.user_id!r}; only service users "
            f"{sorted(self.services)} may send it"
        )


def sender_check(settings: Settings) -> SenderCheck:
    """The check a service of these settings applies to what it consumes: the user of its own
    broker.amqp_url is a service, as are security.service_users."""
    security = settings.security
    services = frozenset({amqp_user(settings.broker.amqp_url), *security.service_users})
    return SenderCheck(security.per_client_users, services, settings.job.name)


def default_client_id(settings: Settings) -> str:
    """A secured client's id when none is given: the client of this job its RabbitMQ user is
    (else the user itself, which the client's handle then refuses, saying why)."""
    user = amqp_user(settings.broker.amqp_url)
    return user_client(settings.job.name, user) or user


def service_user(settings: ConnectionSettings) -> str | None:
    """The user_id a service's publishes carry (`Backends.open_broker(stamp=...)`): its AMQP
    user in the secured mode, where RabbitMQ's check of it is what lets a consumer trust it
    (design §3); None otherwise."""
    return amqp_user(settings.broker.amqp_url) if settings.security.per_client_users else None
