"""Connecting to RabbitMQ: settings, connection parameters, backoff, and error classification.

Only connection-level failures are retried, with capped exponential backoff and jitter, for at
most `give_up_after` seconds per outage. Authentication failures and channel errors are not:
retrying a wrong password or a conflicting declaration only hides the bug.
"""

from __future__ import annotations

import random
import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal
from urllib.parse import quote

import pika
import pika.exceptions

from broker.errors import BrokerAuthError, BrokerUnavailableError, ConnectionSettingsError
from broker.tls import TLSOptions, client_context, wants_tls
from broker.transport import DEFAULT_MAX_MESSAGE_BYTES, Backoff

# Failures of the credentials or vhost: a reconnect cannot fix them.
AUTH_FAILURES = (
    pika.exceptions.AuthenticationError,
    pika.exceptions.ProbableAuthenticationError,
    pika.exceptions.ProbableAccessDeniedError,
)


# Everything pika raises on purpose; ChannelError and ReentrancyError are not AMQPErrors but
# are usage faults we still report as our BrokerError rather than leak. pika resolves the host
# itself and lets a DNS failure through as it is: a compose service name resolves only once
# its container exists, so that is an outage like a refused connection.
PIKA_ERRORS = (
    pika.exceptions.AMQPError,
    pika.exceptions.ChannelError,
    pika.exceptions.ReentrancyError,
    socket.gaierror,
)


@dataclass(frozen=True)
class RabbitMQOptions:
    """Connection settings; they override the same settings given in the URL's query string."""

    # Seconds between heartbeats (0 disables). A handle services heartbeats whenever it is
    # called, so a consumer should call `get` at least this often.
    heartbeat: int = 30
    # Tear the connection down if RabbitMQ blocks our publishes (memory/disk alarm) this long.
    blocked_connection_timeout: float = 120.0
    socket_timeout: float = 10.0
    # Connection attempts per outage (None: as many as fit in `give_up_after`).
    connection_attempts: int | None = None
    reconnect_initial_delay: float = 0.2
    reconnect_max_delay: float = 5.0
    # Seconds of continuous unreachability before an operation raises BrokerUnavailableError.
    give_up_after: float = 60.0
    # The server's max_message_size; larger bodies are refused before they are sent, because
    # RabbitMQ answers an oversize publish by closing the channel.
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    # Shown by `rabbitmqctl list_connections client_properties` (default: splitmq-<pid>-<random>).
    connection_name: str | None = None
    # TLS for amqps:// URLs (None: system CAs, hostname checked); refused with amqp://.
    tls: TLSOptions | None = None
    # Only check that exchanges and queues exist (passive declares, no bindings): for a user
    # without configure permission, whose queues an operator declared.
    passive_declare: bool = False
    # Dead-letter by nack (requeue=False) instead of publishing a copy to `splitmq.dead`: for a
    # user without write permission there. The queue's own x-dead-letter routing moves it and
    # RabbitMQ records x-death, but our x-splitmq-reason/-queue/-user headers are lost (the
    # reason is logged at WARNING instead).
    dead_letter_by_nack: bool = False
    # How the job's durable queues are kept (`broker.rabbitmq_declare.queue_arguments`):
    # "quorum" replicates each over the cluster's nodes (Raft), so a node's death loses none of
    # their messages; "classic" keeps each on one node (a single-node broker's default).
    queue_type: Literal["classic", "quorum"] = "classic"
    # Quorum queues only: a message returned this many times (its consumer died or requeued
    # it) is dead-lettered instead of delivered again, so one that crashes every worker cannot
    # go round for ever.
    delivery_limit: int = 20


def connection_parameters(
    url: str, options: RabbitMQOptions, connection_name: str
) -> pika.URLParameters:
    """pika parameters for an ``amqp://`` or ``amqps://`` URL (amqps verifies the server,
    with `options.tls`)."""
    secure = wants_tls(url, "amqp", "RabbitMQ", "broker.amqp_url, SPLITMQ_AMQP_URL", options.tls)
    try:
        params = pika.URLParameters(url)
    except ValueError as exc:  # e.g. a port that is not a number
        raise ConnectionSettingsError(f"unusable RabbitMQ URL (broker.amqp_url): {exc}") from None
    if secure:
        # pika's own default context has no server_hostname, so it cannot check the name.
        context = client_context(options.tls or TLSOptions())
        params.ssl_options = pika.SSLOptions(context, server_hostname=params.host)
    params.heartbeat = options.heartbeat
    params.blocked_connection_timeout = options.blocked_connection_timeout
    params.socket_timeout = options.socket_timeout
    # One attempt per connect: our own loop retries, with backoff and a total deadline.
    params.connection_attempts = 1
    params.client_properties = {"connection_name": connection_name}
    return params


def server_url(params: pika.ConnectionParameters) -> str:
    """Where `params` connect, as a URL without the password (safe to print)."""
    scheme = "amqps" if params.ssl_options is not None else "amqp"
    user = getattr(params.credentials, "username", "")
    vhost = quote(params.virtual_host, safe="")
    return f"{scheme}://{user}@{params.host}:{params.port}/{vhost}"


def auth_refused(
    exc: BaseException, what: str, params: pika.ConnectionParameters
) -> BrokerAuthError:
    """The error for a refused login or vhost, saying which of the two and what to fix."""
    user = getattr(params.credentials, "username", "")
    if isinstance(exc, pika.exceptions.ProbableAccessDeniedError):
        problem = (
            f"user {user!r} has no access to vhost {params.virtual_host!r} (or it does not exist)"
        )
    else:
        problem = f"wrong password for user {user!r}, or no such user"
    return BrokerAuthError(
        f"{what}: RabbitMQ at {server_url(params)} refused user {user!r}: {problem} "
        f"({_root_cause(exc)})"
    )


def _root_cause(exc: BaseException) -> str:
    """The innermost reason pika wrapped: its connection errors nest their causes in args."""
    seen = 0
    while seen < 8 and exc.args and isinstance(exc.args[0], BaseException):
        exc, seen = exc.args[0], seen + 1
    inner = getattr(exc, "exception", None)  # AMQPConnectorSocketConnectError and kin
    if isinstance(inner, BaseException):
        exc = inner
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    if isinstance(exc, pika.exceptions.ConnectionClosed):
        return f"{exc.reply_code}: {exc.reply_text}"
    if exc.args and isinstance(exc.args[0], str) and len(exc.args) == 1:
        return exc.args[0]
    return str(exc) or type(exc).__name__


def describe(exc: BaseException) -> str:
    """A one-line account of a pika exception, with the broker's reply code and text if any."""
    if isinstance(exc, pika.exceptions.ConnectionClosed | pika.exceptions.ChannelClosed):
        return f"{type(exc).__name__} ({exc.reply_code}: {exc.reply_text})"
    if isinstance(exc, pika.exceptions.AMQPConnectionError | OSError):
        # Not pika's nesting of reprs ("AMQPConnectionError: (AMQPConnectorSocketConnectError:
        # ConnectionRefusedError(111, 'Connection refused'),)"): the reason a person can act on.
        return _root_cause(exc)
    text = str(exc) or repr(exc)
    return f"{type(exc).__name__}: {text}"


class Outage:
    """One period of unreachability: counts attempts, sleeps between them, gives up in time."""

    def __init__(
        self,
        options: RabbitMQOptions,
        *,
        clock: Callable[[], float],
        sleep: Callable[[float], None],
        rng: random.Random,
        where: str = "",
    ) -> None:
        self._options = options
        self._where = f" at {where}" if where else ""
        self._clock = clock
        self._sleep = sleep
        self._rng = rng
        self._backoff = Backoff(options.reconnect_initial_delay, options.reconnect_max_delay)
        self._started = clock()
        self.attempts = 0

    def wait_or_give_up(self, exc: BaseException, what: str) -> None:
        """Sleep before the next attempt, or raise `BrokerUnavailableError` if none is left."""
        self.attempts += 1
        elapsed = self._clock() - self._started
        delay = self._backoff.delay(self.attempts - 1, self._rng)
        limit = self._options.connection_attempts
        if (limit is not None and self.attempts >= limit) or (
            elapsed + delay > self._options.give_up_after
        ):
            raise BrokerUnavailableError(
                f"{what}: RabbitMQ unreachable{self._where} ({describe(exc)}); gave up "
                f"after {self.attempts} attempt(s) in {elapsed:.1f} s"
            ) from exc
        self._sleep(delay)
