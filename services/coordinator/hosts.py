"""Client hosts at the coordinator (docs/architecture.md, "Client hosts"): what a host may say
for whom, and the bindings that route a hosted client's replies to its host's queue.

Only the coordinator binds (a host user may configure nothing), and only the key of a client
of the host the Join names (`client_host`), so no host can have another's replies routed to
it. Bindings stay after a Leave or an expiry: a client that comes back finds its route.
"""

from __future__ import annotations

from broker.errors import BrokerError, BrokerUnavailableError
from broker.messages import HostHeartbeat, Join
from broker.topology import host_queue
from broker.transport import Broker, Delivery
from services.common.membership import HOST_HEARTBEAT_MEMBERS, HOST_INFO_KEY
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
    return None


def host_heartbeat_problem(
    message: HostHeartbeat, senders: SenderCheck, delivery: Delivery
) -> str | None:
    """Why a HostHeartbeat is refused whole (None: it is not)."""
    host = message.client
    problem = host_id_problem(host) or senders.host_problem(delivery, host)
    if problem is not None:
        return problem
    if len(message.members) > HOST_HEARTBEAT_MEMBERS:
        return (
            f"HostHeartbeat of host {host!r} lists {len(message.members)} members; at most "
            f"{HOST_HEARTBEAT_MEMBERS} per message"
        )
    strangers = [
        c for c in message.members if client_id_problem(c) is not None or client_host(c) != host
    ]
    if strangers:
        return (
            f"HostHeartbeat of host {host!r} lists {len(strangers)} clients not its own "
            f"({host}-<n>), e.g. {strangers[0][:80]!r}"
        )
    return None


class HostBindings:
    """Binds hosted clients' reply keys to their host's queue, once per client and run."""

    def __init__(self, broker: Broker, job: str) -> None:
        self._broker = broker
        self._job = job
        self._bound: set[str] = set()

    def bind(self, message: Join) -> str | None:
        """Route the joining client's replies to the host its Join names, if any, before
        anything is sent to it; the reason to dead-letter the Join if RabbitMQ refuses."""
        host = message.info.get(HOST_INFO_KEY)
        if host is None or message.client in self._bound:
            return None
        try:
            self._broker.declare([host_queue(self._job, host, message.client)])
        except BrokerUnavailableError:
            raise
        except BrokerError as exc:
            return f"cannot bind client {message.client!r}'s replies to host {host!r}: {exc}"
        self._bound.add(message.client)
        return None

    def forget(self, client: str) -> None:
        """Bind `client` again at its next Join (its replies found no queue)."""
        self._bound.discard(client)
