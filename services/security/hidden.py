"""Reply queue names nobody else can guess (the secured mode; docs/deployment.md, "Security").

RabbitMQ (3.x) checks no permission on a passive `queue.declare`: any user of the vhost may ask
whether a queue exists and how deep it is, by name. The default names (`<job>.reply.<client>`)
are guessable, so in the secured mode each client's reply and split-inference reply queue gets
a secret part, `<job>.reply.<client>.<32 hex digits>`: 128 bits of an HMAC-SHA256 keyed with
the client's own RabbitMQ password over the default name. Only the client (whose URL holds the
password) and `splitmq provision-clients` (which made it) can compute it; the services never
need it, because they publish replies by routing key (`<job>.<client>`), which stays as it is.
A client host's queue is hidden the same way with the host user's password
(`<job>.host.<H>.<32 hex digits>`); the coordinator, which binds the host's clients' keys to
it, learns the name from their Joins and checks only its shape (`hidden_of`).

Derived rather than drawn at random so that the env file needs no second secret and no new
setting: the password is already the client's one secret, and a new password (`--force`)
gives new names, so the old queues (with whatever was left for the old holder) are dropped.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from urllib.parse import unquote, urlparse

from broker.topology import (
    client_infer_reply_queue,
    host_queue,
    host_queue_name,
    infer_reply_queue_name,
    reply_queue,
    reply_queue_name,
)
from broker.transport import QueueSpec

_HEX_DIGITS = 32  # 128 bits
_CONTEXT = b"splitmq reply queue name\x00"  # this key's one use, apart from any other
_HIDDEN = re.compile(f"[0-9a-f]{{{_HEX_DIGITS}}}")


def hidden_part(secret: str, name: str) -> str:
    """The secret part of queue `name`'s real name for the user whose password is `secret`;
    `""` (the name unchanged) without one: the open mode."""
    if not secret:
        return ""
    mac = hmac.new(secret.encode(), _CONTEXT + name.encode(), hashlib.sha256)
    return mac.hexdigest()[:_HEX_DIGITS]


def queue_secret(per_client_users: bool, amqp_url: str) -> str:
    """What hides a client's queue names: its RabbitMQ password in the secured mode, nothing
    in the open mode (where every role uses the default names)."""
    if not per_client_users:
        return ""
    password = urlparse(amqp_url).password
    return unquote(password) if password else ""


def client_hidden(job: str, client: str, secret: str) -> tuple[str, str]:
    """The hidden parts of a client's (reply, split-inference reply) queue names."""
    return (
        hidden_part(secret, reply_queue_name(job, client)),
        hidden_part(secret, infer_reply_queue_name(job, client)),
    )


def client_reply_queue(job: str, client: str, secret: str) -> QueueSpec:
    return reply_queue(job, client, hidden=client_hidden(job, client, secret)[0])


def client_infer_queue(job: str, client: str, secret: str) -> QueueSpec:
    return client_infer_reply_queue(job, client, hidden=client_hidden(job, client, secret)[1])


def host_reply_queue(job: str, host: str, secret: str, client: str | None = None) -> QueueSpec:
    """Client host `host`'s queue (with `client`: its binding of that client's replies), named
    after the host user's password `secret`."""
    hidden = hidden_part(secret, host_queue_name(job, host))
    return host_queue(job, host, client, hidden=hidden)


def hidden_of(name: str, default: str) -> str | None:
    """The hidden part of queue `name`, the queue named `default` (`""`: the default name
    itself, the open mode); None if `name` is neither `default` nor `default`, '.' and 32
    lowercase hex digits. What the coordinator checks before it binds to a name a host
    sent: it cannot check the part itself (it knows no password), only that the name is of
    that host's queue and of no other."""
    if name == default:
        return ""
    hidden = name[len(default) + 1 :]
    if name.startswith(f"{default}.") and _HIDDEN.fullmatch(hidden):
        return hidden
    return None


def is_queue_of(name: str, default: str) -> bool:
    """Whether queue `name` is the queue named `default`, under any hidden part (or none): what
    revoking and re-provisioning a client must find without its password. Client ids and job
    names hold no '.', so `<job>.reply.a.` never starts another client's name."""
    return name == default or name.startswith(f"{default}.")
