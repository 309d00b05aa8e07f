"""Who a message says it comes from, and whether the broker's word agrees (the rules:
services/security/identity.py): a client id is a plain id, and the AMQP user a delivery came
from may speak for the client (or the service) the message names."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from broker.rejection import Rejection
from broker.transport import Delivery
from services.security.identity import CLIENT_ID, SenderCheck, client_id_problem

# Verdicts a `ClientSender` keeps: (AMQP user, client) pairs, far more than a job's clients.
_MAX_VERDICTS = 4096


class FromClient(Protocol):
    @property
    def client(self) -> str: ...


@dataclass(frozen=True, slots=True)
class NamesClient:
    """A message without a client id is refused (before its id's shape is judged)."""

    code: str

    def __call__(self, delivery: Delivery, message: FromClient, /) -> Rejection | None:
        if message.client:
            return None
        return Rejection(self.code, f"{type(message).__name__} without a client id")


@dataclass(frozen=True, slots=True)
class ClientIdShape:
    """A client id must be a plain id: it becomes part of queue names and store keys."""

    code: str

    def __call__(self, delivery: Delivery, message: FromClient, /) -> Rejection | None:
        # `client_id_problem`'s own test, so that a valid id (every batch) costs no more calls.
        if CLIENT_ID.match(message.client):
            return None
        return Rejection(self.code, str(client_id_problem(message.client)))


@dataclass(frozen=True, slots=True)
class ClientSender:
    """The delivery's AMQP user must be the client's own, or its host's. The verdict depends on
    the (user, client) pair alone, asked of every message of a client: it is kept."""

    senders: SenderCheck
    code: str
    _verdicts: dict[tuple[str | None, str], str | None] = field(
        default_factory=dict, compare=False, repr=False
    )

    def __call__(self, delivery: Delivery, message: FromClient, /) -> Rejection | None:
        key, verdicts = (delivery.user_id, message.client), self._verdicts
        if key in verdicts:
            problem = verdicts[key]
        else:
            problem = self.senders.client_problem(delivery, message.client)
            if len(verdicts) >= _MAX_VERDICTS:  # a flood of made-up ids
                verdicts.clear()
            verdicts[key] = problem
        return None if problem is None else Rejection(self.code, problem)


@dataclass(frozen=True, slots=True)
class ServiceSender:
    """A service's message (a round marker) must come from a service user (secured mode)."""

    senders: SenderCheck
    code: str

    def __call__(self, delivery: Delivery, message: object, /) -> Rejection | None:
        problem = self.senders.service_problem(delivery, type(message).__name__)
        return None if problem is None else Rejection(self.code, problem)
