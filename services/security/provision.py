"""One RabbitMQ user per client (or client host) and job (design §3): what each may do, and the
files that say how.

Client `c` of job `j` logs in as `j.c` (`identity.client_user`), client host `H` as `j.host.H`
(`identity.host_user`), so provisioning or revoking one job never resets or deletes another's.
A user that exists already is refused unless told to reset it (`force`): a reset locks out
whichever client holds the old password. The permissions and why each is what it is:
docs/deployment.md, "Provisioning client users". Neither may configure anything (a bind would
let it copy another client's replies), so `provision` declares their queues with the services'
handle. A host speaks for the clients `H-<n>`, so a client user of that shape and a host `H`
are never both provisioned (`ClientOfHostError`).
"""

from __future__ import annotations

import os
import re
import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from urllib.parse import quote, unquote, urlparse, urlunparse

from broker.topology import (
    CONTROL_EXCHANGE,
    SMASHED_EXCHANGE,
    client_queue_names,
    host_queue_name,
)
from broker.transport import Broker, QueueSpec
from services.security.admin import AdminError, Permissions, RabbitAdmin, TopicPermission
from services.security.hidden import (
    client_infer_queue,
    client_reply_queue,
    host_reply_queue,
    is_queue_of,
)
from services.security.identity import (
    client_host,
    client_id_problem,
    client_user,
    host_id_problem,
    host_user,
    user_client,
    user_host,
)


class UsersExistError(AdminError):
    """Provisioning would reset users that exist already (and lock their clients out)."""


class ClientOfHostError(AdminError):
    """A client user `H-<n>` and a host user `H` of one job: the host could speak for it."""


def _permissions(job: str, read_queues: Sequence[str]) -> Permissions:
    """Write on the two exchanges clients publish to, with their own job's routing keys only
    (topic permissions): shard and infer keys `<job>.<n>`, `<job>.infer` on the smashed
    exchange; the control and updates keys `<job>`, `<job>.updates` on the control exchange.
    A job name holds no '.', so no key of job `a` is a key of another job (`a.b` would be)."""
    if "." in job:
        raise ValueError(f"job name {job!r} holds a '.': its routing keys would be ambiguous")
    write = "|".join(re.escape(name) for name in (SMASHED_EXCHANGE, CONTROL_EXCHANGE))
    read = "|".join(re.escape(name) for name in read_queues)
    own = re.escape(job)
    topics = (
        TopicPermission(SMASHED_EXCHANGE, write=f"^{own}\\.([0-9]+|infer)$", read="^$"),
        TopicPermission(CONTROL_EXCHANGE, write=f"^{own}(\\.updates)?$", read="^$"),
    )
    return Permissions("^$", write=f"^({write})$", read=f"^({read})$", topics=topics)


def client_permissions(job: str, client: str, secret: str = "") -> Permissions:
    """What client user `client` may do; `secret`, its password, hides its queues' names."""
    return _permissions(job, [spec.name for spec in client_queues(job, client, secret)])


def host_permissions(job: str, host: str, secret: str = "") -> Permissions:
    """A host reads its one queue, where the coordinator binds its own clients' replies only;
    `secret`, its password, hides the queue's name."""
    return _permissions(job, (host_reply_queue(job, host, secret).name,))


def client_queues(job: str, client: str, secret: str = "") -> list[QueueSpec]:
    """The queues a client user reads, declared for it (it may not): training replies and
    split-inference replies, under names hidden by its password `secret` (`hidden.py`)."""
    return [client_reply_queue(job, client, secret), client_infer_queue(job, client, secret)]


@dataclass(frozen=True)
class Credentials:
    name: str  # the client's id, or the host's
    user: str  # its RabbitMQ user, `client_user(job, name)` or `host_user(job, name)`
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


def host_names(text: str) -> list[str]:
    """`"H1,H2"` → ["H1", "H2"]; ValueError on a bad host id."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    for name in names:
        problem = host_id_problem(name)
        if problem is not None:
            raise ValueError(f"--hosts: {problem}")
    return names


def env_file(job: str, creds_url: str, client: str) -> str:
    """What a client of the secured mode sets (its id follows from its RabbitMQ user)."""
    return _env(
        f"client {client} of job {job} (RabbitMQ user {client_user(job, client)})",
        "splitmq client CONFIG",
        creds_url,
    )


def host_env_file(job: str, creds_url: str, host: str) -> str:
    """What a client host of the secured mode sets."""
    return _env(
        f"client host {host} of job {job} (RabbitMQ user {host_user(job, host)})",
        f"splitmq clients CONFIG --host {host}",
        creds_url,
    )


def _env(who: str, command: str, creds_url: str) -> str:
    return (
        f"# SplitMQ {who}:\n"
        f"# `{command}` with these set.\n"
        "# Keep this file secret: it holds the RabbitMQ password.\n"
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


@dataclass(frozen=True)
class _Account:
    name: str
    user: str
    password: str
    permissions: Permissions
    queues: list[QueueSpec]
    env: Callable[[str], str]  # the env file, given the URL
    defaults: list[str]  # its queues' default names: those of earlier passwords start so


def _client_account(job: str, client: str) -> _Account:
    password = secrets.token_urlsafe(24)
    return _Account(
        client,
        client_user(job, client),
        password,
        client_permissions(job, client, password),
        client_queues(job, client, password),
        partial(env_file, job, client=client),
        client_queue_names(job, client),
    )


def _host_account(job: str, host: str) -> _Account:
    # Hidden as a client's queues are; the host tells the coordinator the name in its
    # clients' Joins (services/coordinator/hosts.py), so the coordinator needs no password.
    password = secrets.token_urlsafe(24)
    return _Account(
        host,
        host_user(job, host),
        password,
        host_permissions(job, host, password),
        [host_reply_queue(job, host, password)],
        partial(host_env_file, job, host=host),
        [host_queue_name(job, host)],
    )


def _accounts(job: str, clients: Sequence[str], hosts: Sequence[str]) -> list[_Account]:
    return [_client_account(job, c) for c in clients] + [_host_account(job, h) for h in hosts]


def _earlier_queues(names: frozenset[str], defaults: Sequence[str]) -> list[str]:
    """Which of `names` are queues of these default names, under any hidden part or none."""
    return sorted(n for n in names if any(is_queue_of(n, d) for d in defaults))


def _check_hosts(job: str, clients: Sequence[str], hosts: Sequence[str], users: set[str]) -> None:
    """Refuse a client `H-<n>` beside a host `H` (either new or provisioned before)."""
    all_hosts = {*hosts, *(h for u in users if (h := user_host(job, u)) is not None)}
    all_clients = {*clients, *(c for u in users if (c := user_client(job, u)) is not None)}
    clashes = sorted(c for c in all_clients if client_host(c) in all_hosts)
    if clashes:
        owners = ", ".join(sorted({str(client_host(c)) for c in clashes}))
        raise ClientOfHostError(
            f"job {job}: client ids {', '.join(clashes[:5])} have the shape <host>-<n> of the "
            f"clients of host {owners}, which could speak for them; use another --prefix or "
            "another host id"
        )


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
    hosts: Sequence[str] = (),
) -> list[Credentials]:
    """Create each client's and host's user and permissions, declare its queues with the
    services' handle, and write its env file; returns what was written. Users of this job that
    exist already are refused (`UsersExistError`, before anything is changed) unless `force`,
    which gives them new passwords; a client of a host's shape is always refused."""
    accounts = _accounts(job, clients, hosts)
    present = set(admin.users())
    existing = sorted({a.user for a in accounts} & present)
    if existing and not force:
        raise UsersExistError(
            f"RabbitMQ users {', '.join(existing)} exist already (job {job} was provisioned "
            "before); resetting them would lock out the clients holding their passwords. "
            "Use --force to reset them anyway, or --revoke them first"
        )
    _check_hosts(job, clients, hosts, present)
    queues = admin.queues(vhost) if clients or hosts else frozenset()
    services.declare([spec for account in accounts for spec in account.queues])
    written: list[Credentials] = []
    for account in accounts:
        password = account.password
        admin.put_user(account.user, password)
        admin.set_permissions(vhost, account.user, account.permissions)
        # Queues of an earlier password (or of the default names, before names were hidden):
        # nobody reads them any more, and they hold what was left for the old holder.
        current = {spec.name for spec in account.queues}
        for name in _earlier_queues(queues, account.defaults):
            if name not in current:
                services.delete_queue(name)
        url = client_url(url_template, account.user, password)
        path = out_dir / f"{account.user}.env"  # per job too: jobs may share `out_dir` and ids
        write_secret(path, account.env(url))
        written.append(Credentials(account.name, account.user, password, url, path))
    return written


def revoke(
    admin: RabbitAdmin,
    services: Broker,
    *,
    job: str,
    clients: Sequence[str],
    hosts: Sequence[str] = (),
    vhost: str = "/",
) -> None:
    """Delete each client's and host's user of this job, and the queues `provision` declared
    for it: they are durable, so they would otherwise outlive the user, holding whatever
    replies were left for it. A client's queue names hold a part of its password, which is
    not kept, so they are found by their prefix among `vhost`'s queues (the default names of
    earlier releases too); so are a host's. Another job's users, even of the same ids, are
    not touched."""
    queues = admin.queues(vhost) if clients or hosts else frozenset()
    for client in clients:
        admin.delete_user(client_user(job, client))
        for name in _earlier_queues(queues, client_queue_names(job, client)):
            services.delete_queue(name)
    for host in hosts:
        admin.delete_user(host_user(job, host))
        for name in _earlier_queues(queues, [host_queue_name(job, host)]):
            services.delete_queue(name)
