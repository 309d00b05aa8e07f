"""Who may send what: client ids, the AMQP user a message came from, stamping our own.

RabbitMQ validates the `user_id` property against the publishing connection's user, so a
delivery's `user_id`, when present, is the broker's word for who sent it; each consumer holds
a message to it through a `SenderCheck` (the rules per consumer and mode: docs/deployment.md,
"Two modes"). Client ids also become parts of queue names, routing keys (at most 255 bytes) and
store keys, so every service refuses a client field that is not a plain id.

A client's RabbitMQ user is `<job>.<client>`: neither ids nor job names hold a '.', so the name
says both unambiguously; every comparison of a `user_id` with a client id goes through
`client_user` / `user_client`.
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
        """Why a client's message may not claim to come from `client` (None: it may)."""
        user = delivery.user_id
        if user:
            if user != client_user(self.job, client):
                return f"client {client!r} does not match the AMQP user {user!r}"
            return None
        if self.secured:
            return (
                f"no AMQP user_id on a message of client {client!r}: the secured mode "
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
