"""One RabbitMQ user per client and job (design §3): what each may do, and the files that say how.

Client `c` of job `j` logs in as `j.c` (`identity.client_user`), so provisioning or revoking
one job never resets or deletes another's. A user that exists already is refused unless told
to reset it (`force`): a reset locks out whichever client holds the old password. The
permissions and why each is what it is: docs/deployment.md, "Provisioning client users". A
client user may configure nothing (a bind would let it copy another client's replies), so
`provision` declares its queues with the services' handle.
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
    SMASHED_EXCHANGE,
    client_infer_reply_queue,
    client_queue_names,
    infer_reply_queue_name,
    reply_queue,
    reply_queue_name,
)
from broker.transport import Broker, QueueSpec
from services.security.admin import AdminError, Permissions, RabbitAdmin
from services.security.identity import client_id_problem, client_user


class UsersExistError(AdminError):
    """Provisioning would reset users that exist already (and lock their clients out)."""


def client_permissions(job: str, client: str) -> Permissions:
    write = "|".join(re.escape(name) for name in (SMASHED_EXCHANGE, CONTROL_EXCHANGE))
    queues = (reply_queue_name(job, client), infer_reply_queue_name(job, client))
    read = "|".join(re.escape(name) for name in queues)
    return Permissions(configure="^$", write=f"^({write})$", read=f"^({read})$")


def client_queues(job: str, client: str) -> list[QueueSpec]:
    """The queues a client user reads, declared for it (it may not): training replies and
    split-inference replies."""
    return [reply_queue(job, client), client_infer_reply_queue(job, client)]


@dataclass(frozen=True)
class Credentials:
    client: str
    user: str  # its RabbitMQ user, `client_user(job, client)`
    password: str
    amqp_url: str  # the URL the client connects with (its user and password in it)
    path: Path  # the env file holding them, `<user>.env`


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
    """What a client of the secured mode sets (its id follows from its RabbitMQ user)."""
    return (
        f"# SplitMQ client {client} of job {job} (RabbitMQ user {client_user(job, client)}):\n"
        "# `splitmq client CONFIG` with these set.\n"
        "# Keep this file secret: it holds the client's RabbitMQ password.\n"
        "SPLITMQ_BROKER=rabbitmq\n"
        f"SPLITMQ_AMQP_URL={creds_url}\n"
        "SPLITMQ_SECURITY__PER_CLIENT_USERS=true\n"
        "SPLITMQ_BROKER__PASSIVE_DECLARE=true\n"
        "SPLITMQ_BROKER__DEAD_LETTER_BY_NACK=true\n"
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
    force: bool = False,
) -> list[Credentials]:
    """Create each client's user and permissions, declare its reply queues with the services'
    handle, and write its env file; returns what was written. Users of this job that exist
    already are refused (`UsersExistError`, before anything is changed) unless `force`, which
    gives them new passwords."""
    users = {client: client_user(job, client) for client in clients}
    existing = sorted(set(users.values()) & admin.users())
    if existing and not force:
        raise UsersExistError(
            f"RabbitMQ users {', '.join(existing)} exist already (job {job} was provisioned "
            "before); resetting them would lock out the clients holding their passwords. "
            "Use --force to reset them anyway, or --revoke them first"
        )
    services.declare([spec for client in clients for spec in client_queues(job, client)])
    written: list[Credentials] = []
    for client in clients:
        user, password = users[client], secrets.token_urlsafe(24)
        admin.put_user(user, password)
        admin.set_permissions(vhost, user, client_permissions(job, client))
        url = client_url(url_template, user, password)
        path = out_dir / f"{user}.env"  # per job too: jobs may share `out_dir` and ids
        write_secret(path, env_file(job, url, client))
        written.append(Credentials(client, user, password, url, path))
    return written


def revoke(admin: RabbitAdmin, services: Broker, *, job: str, clients: Sequence[str]) -> None:
    """Delete each client's user of this job, and the queues `provision` declared for it: they
    are durable, so they would otherwise outlive the user, holding whatever replies were left
    for it. Another job's users, even of the same client ids, are not touched."""
    for client in clients:
        admin.delete_user(client_user(job, client))
        for name in client_queue_names(job, client):
            services.delete_queue(name)
