"""One RabbitMQ user per client (design §3): what each may do, and the files that say how.

A client's user may
- **configure** nothing: it cannot declare, bind or delete any exchange or queue (a bind would
  let it copy another client's replies into a queue of its own); its handle only checks that
  they exist (`broker.passive_declare`), so `provision` declares them first;
- **write** to the exchanges clients publish to: `splitmq.smashed` (smashed data, inference
  requests), `splitmq.control` (Join, Heartbeat, Leave, WeightsUpdate, RoundDropped) and
  `splitmq.dead` (to dead-letter a bad reply with its reason), and nothing else: not the
  replies or events exchanges, so it can forge neither a gradient nor an event;
- **read** its own reply queue, `<job>.reply.<client>`, and its own inference reply queue,
  `<job>.infer-reply.<client>` (split inference, SplitGP), and no other queue.

Its publishes carry its user as the AMQP `user_id`, which RabbitMQ validates, and the services
dead-letter a client message without one, or whose `client` field names another user.
"""

from __future__ import annotations

import os
import re
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote, unquote, urlparse, urlunparse

from broker.topology import (
    CONTROL_EXCHANGE,
    DEAD_EXCHANGE,
    SMASHED_EXCHANGE,
    client_infer_reply_queue,
    client_queue_names,
    infer_reply_queue_name,
    reply_queue,
    reply_queue_name,
)
from broker.transport import Broker, QueueSpec
from services.security.admin import Permissions, RabbitAdmin
from services.security.identity import client_id_problem

CLIENT_EXCHANGES = (SMASHED_EXCHANGE, CONTROL_EXCHANGE, DEAD_EXCHANGE)


def client_permissions(job: str, client: str) -> Permissions:
    write = "|".join(re.escape(name) for name in CLIENT_EXCHANGES)
    queues = (reply_queue_name(job, client), infer_reply_queue_name(job, client))
    read = "|".join(re.escape(name) for name in queues)
    return Permissions(configure="^$", write=f"^({write})$", read=f"^({read})$")


def client_queues(job: str, client: str) -> list[QueueSpec]:
    """The queues a client user reads, declared for it (it may not): training replies and
    split-inference replies."""
    return [reply_queue(job, client), client_infer_reply_queue(job, client)]


@dataclass(frozen=True)
class Credentials:
    client: str  # also the RabbitMQ user
    password: str
    amqp_url: str  # the URL the client connects with (its user and password in it)
    path: Path  # the env file holding them


def vhost_of(amqp_url: str) -> str:
    path = urlparse(amqp_url).path
    return unquote(path[1:]) if len(path) > 1 else "/"


def client_url(template: str, user: str, password: str) -> str:
    """`template` (an amqp:// or amqps:// URL) logging in as `user`."""
    parsed = urlparse(template)
    host = parsed.hostname or "127.0.0.1"
    if ":" in host:
        host = f"[{host}]"  # an IPv6 address
    netloc = f"{quote(user, safe='')}:{quote(password, safe='')}@{host}"
    if parsed.port:
        netloc += f":{parsed.port}"
    path = parsed.path if len(parsed.path) > 1 else "/%2F"
    return urlunparse((parsed.scheme, netloc, path, "", parsed.query, ""))


def client_names(prefix: str, count: int, start: int = 0) -> list[str]:
    names = [f"{prefix}{i}" for i in range(start, start + count)]
    for name in names:
        problem = client_id_problem(name)
        if problem is not None:
            raise ValueError(f"--prefix makes a bad client id: {problem}")
    return names


def env_file(job: str, creds_url: str, client: str) -> str:
    """What a client of the secured mode sets (its id is its RabbitMQ user)."""
    return (
        f"# SplitMQ client {client} of job {job}: `splitmq client CONFIG` with these set.\n"
        "# Keep this file secret: it holds the client's RabbitMQ password.\n"
        "SPLITMQ_BROKER=rabbitmq\n"
        f"SPLITMQ_AMQP_URL={creds_url}\n"
        "SPLITMQ_SECURITY__PER_CLIENT_USERS=true\n"
        "SPLITMQ_BROKER__PASSIVE_DECLARE=true\n"
    )


def write_secret(path: Path, text: str) -> None:
    """Write `text` readable by its owner only (created that way: never briefly world-readable)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(text)
    os.chmod(path, 0o600)  # an existing file keeps its mode through O_CREAT


def provision(
    admin: RabbitAdmin,
    services: Broker,
    *,
    job: str,
    clients: Sequence[str],
    vhost: str,
    url_template: str,
    out_dir: Path,
) -> list[Credentials]:
    """Create (or reset) each client's user and permissions, declare its reply queues with the
    services' handle, and write its env file; returns what was written."""
    services.declare([spec for client in clients for spec in client_queues(job, client)])
    written: list[Credentials] = []
    for client in clients:
        password = secrets.token_urlsafe(24)
        admin.put_user(client, password)
        admin.set_permissions(vhost, client, client_permissions(job, client))
        url = client_url(url_template, client, password)
        path = out_dir / f"{client}.env"
        write_secret(path, env_file(job, url, client))
        written.append(Credentials(client, password, url, path))
    return written


def revoke(admin: RabbitAdmin, services: Broker, *, job: str, clients: Sequence[str]) -> None:
    """Delete each client's user and the queues `provision` declared for it: they are durable,
    so they would otherwise outlive the user, holding whatever replies were left for it."""
    for client in clients:
        admin.delete_user(client)
        for name in client_queue_names(job, client):
            services.delete_queue(name)
