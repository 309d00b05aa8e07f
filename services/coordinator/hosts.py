"""Client hosts at the coordinator (docs/architecture.md, "Client hosts"): what a host may say
for whom, and the bindings that route a hosted client's replies to its host's queue.

Only the coordinator binds (a host user may configure nothing), and only the key of a client
of the host the Join names (`client_host`), so no host can have another's replies routed to
it. Bindings stay after a Leave or an expiry: a client that comes back finds its route.

The Join names the host's queue too: in the secured mode its name holds a part hidden by the
host's password (services/security/hidden.py), which the coordinator cannot compute. It checks
the name's shape instead (that host's queue and no other's, nor any other queue of the job) and
binds only to a queue that exists, so a Join can neither create a queue nor route replies to a
guessable one.
"""

from __future__ import annotations

from dataclasses import dataclass

from broker.errors import BrokerError, BrokerUnavailableError
from broker.messages import HostHeartbeat, Join
from broker.rejection import Rejection
from broker.topology import host_queue, host_queue_name
from broker.transport import Broker, Delivery
from services.common.membership import HOST_HEARTBEAT_MEMBERS, HOST_INFO_KEY, HOST_QUEUE_INFO_KEY
from services.security.hidden import hidden_of
from services.security.identity import (
    SenderCheck,
    client_host,
    client_id_problem,
    host_id_problem,
)


def join_host_problem(message: Join) -> str | None:
    """Why a Join may not come through the host its info names (None: no host, or it may)."""
    host = message.info.get(HOST_INFO_KEY)
    if host is None:
        return None
    problem = host_id_problem(host)
    if problem is not None:
        return f"Join of client {message.client!r} through a bad host: {problem}"
    if client_host(message.client) != host:
        return (
            f"Join of client {message.client!r} through host {host!r}: a host's clients "
            f"are {host}-<n>"
        )
    return _host_queue_problem(message, host)


def host_queue_hidden(message: Join, host: str) -> str | None:
    """The hidden part of the host queue the Join names (`""`: the default name, also when it
    names none, as hosts of earlier releases); None if the name is not of `host`'s queue."""
    name = message.info.get(HOST_QUEUE_INFO_KEY)
    default = host_queue_name(message.job, host)
    return "" if name is None else hidden_of(name, default)


def _host_queue_problem(message: Join, host: str) -> str | None:
    if host_queue_hidden(message, host) is not None:
        return None
    name = str(message.info.get(HOST_QUEUE_INFO_KEY))[:200]
    default = host_queue_name(message.job, host)
    return (
        f"Join of client {message.client!r} names host queue {name!r}: host {host!r}'s "
        f"queue is {default!r}, or that name, '.' and 32 lowercase hex digits"
    )


@dataclass(frozen=True, slots=True)
class HostSender:
    """A HostHeartbeat names a host id, and comes from that host's AMQP user."""

    senders: SenderCheck

    def __call__(self, delivery: Delivery, message: HostHeartbeat, /) -> Rejection | None:
        host = message.client
        problem = host_id_problem(host) or self.senders.host_problem(delivery, host)
        return None if problem is None else Rejection("bad_host", problem)


def host_members(delivery: Delivery, message: HostHeartbeat, /) -> Rejection | None:
    """A HostHeartbeat lists a bounded number of members, every one the host's own client
    (refused whole: it speaks for no one else)."""
    host = message.client
    if len(message.members) > HOST_HEARTBEAT_MEMBERS:
        detail = (
            f"HostHeartbeat of host {host!r} lists {len(message.members)} members; at most "
            f"{HOST_HEARTBEAT_MEMBERS} per message"
        )
        return Rejection("too_many_members", detail)
    strangers = [
        c for c in message.members if client_id_problem(c) is not None or client_host(c) != host
    ]
    if strangers:
        detail = (
            f"HostHeartbeat of host {host!r} lists {len(strangers)} clients not its own "
            f"({host}-<n>), e.g. {strangers[0][:80]!r}"
        )
        return Rejection("not_its_clients", detail)
    return None


def join_host(delivery: Delivery, message: Join, /) -> Rejection | None:
    """A Join through a host comes through the host its id names, with that host's queue."""
    problem = join_host_problem(message)
    return None if problem is None else Rejection("bad_host", problem)


class HostBindings:
    """Binds hosted clients' reply keys to their host's queue, once per client, queue and run."""

    def __init__(self, broker: Broker, job: str) -> None:
        self._broker = broker
        self._job = job
        self._bound: dict[str, str] = {}  # client -> the queue its key is bound to

    def bind(self, message: Join) -> str | None:
        """Route the joining client's replies to the host queue its Join names, if any (its
        name checked by `join_host_problem`), before anything is sent to it; the reason to
        dead-letter the Join if the queue is missing or RabbitMQ refuses."""
        host = message.info.get(HOST_INFO_KEY)
        hidden = None if host is None else host_queue_hidden(message, host)
        if host is None or hidden is None:
            return None
        spec = host_queue(self._job, host, message.client, hidden=hidden)
        if self._bound.get(message.client) == spec.name:
            return None
        try:
            # Only to a queue that exists: its host (open mode) or provisioning declared it.
            self._broker.queue_depth(spec.name)
        except BrokerUnavailableError:
            raise
        except BrokerError:
            return (
                f"cannot bind client {message.client!r}'s replies to host {host!r}: its "
                f"queue {spec.name!r} does not exist"
            )
        try:
            self._broker.declare([spec])
        except BrokerUnavailableError:
            raise
        except BrokerError as exc:
            return f"cannot bind client {message.client!r}'s replies to host {host!r}: {exc}"
        self._bound[message.client] = spec.name
        return None

    def forget(self, client: str) -> None:
        """Bind `client` again at its next Join (its replies found no queue)."""
        self._bound.pop(client, None)
