"""The control queue's delivery checks, one ordered chain per message type (the concept:
services/common/checks/chain.py). What passes them is the handlers' work: a Join is admitted,
a heartbeat renews, a Leave removes (each may still refuse what the store says: an unknown
member, a replayed Join). The coordinator dead-letters a rejection with its detail alone."""

from __future__ import annotations

from dataclasses import dataclass

from broker.messages import Heartbeat, HostHeartbeat, Join, Leave
from broker.rejection import Rejection
from broker.transport import Delivery
from services.common.checks.addressing import SameJob
from services.common.checks.chain import Check
from services.common.checks.sender import ClientIdShape, ClientSender, NamesClient
from services.coordinator.hosts import HostSender, host_members, join_host
from services.security.identity import SenderCheck

_OTHER_JOB = "message for job {got!r} on job {want!r}'s control queue"
_BAD_SENDER = "bad_sender"


def client_role(delivery: Delivery, message: Heartbeat, /) -> Rejection | None:
    """Only clients are members: a heartbeat of another role is no member's."""
    if message.role == "client":
        return None
    return Rejection("not_client", f"heartbeat of role {message.role!r}: only clients are members")


@dataclass(frozen=True)
class ControlChecks:
    join: tuple[Check[Join], ...]
    heartbeat: tuple[Check[Heartbeat], ...]
    host_heartbeat: tuple[Check[HostHeartbeat], ...]
    leave: tuple[Check[Leave], ...]

    @classmethod
    def of(cls, job: str, senders: SenderCheck) -> ControlChecks:
        """Every message: its job, a client id. A client's: the id's shape and the AMQP user
        (design §3: the broker vouches for user_id; the client field must not claim someone
        else's identity, and in the secured mode a client message must carry one). A host's
        heartbeat: the host's identity and the members it lists."""
        addressed = (SameJob(job, _OTHER_JOB), NamesClient("no_client"))
        client = (*addressed, ClientIdShape(_BAD_SENDER), ClientSender(senders, _BAD_SENDER))
        return cls(
            join=(*client, join_host),
            heartbeat=(*client, client_role),
            host_heartbeat=(*addressed, HostSender(senders), host_members),
            leave=client,
        )
