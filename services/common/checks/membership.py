"""Whether the sender is a member of the job, and of the round's cohort."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

from broker.rejection import Rejection
from broker.transport import Delivery
from services.common.checks.sender import FromClient


@dataclass(frozen=True, slots=True)
class Membership:
    """A stranger's message is refused. `is_member` is the role's view of the members, cached
    as it must be (a flood of made-up ids must not cost a store read each)."""

    is_member: Callable[[str], bool]
    code: str

    def __call__(self, delivery: Delivery, message: FromClient, /) -> Rejection | None:
        if self.is_member(message.client):
            return None
        return Rejection(self.code, f"client {message.client!r} is not a member of the job")


class Cohorts(Protocol):
    """The round whose cohort is known, and its members (with their samples)."""

    @property
    def cohort_round(self) -> int: ...

    @property
    def cohort(self) -> Mapping[str, int]: ...


class OfRound(Protocol):
    @property
    def client(self) -> str: ...

    @property
    def round(self) -> int: ...


@dataclass(frozen=True, slots=True)
class InCohort:
    """A message of the round whose cohort is known must come from a member of it. Other
    rounds' pass (a straggler's, a round whose start this consumer never saw): the cohort is
    the round's business then, not a licence to train."""

    cohorts: Cohorts

    def __call__(self, delivery: Delivery, message: OfRound, /) -> Rejection | None:
        known = self.cohorts.cohort_round
        if message.round != known or message.client in self.cohorts.cohort:
            return None
        detail = f"client {message.client!r} is not in the cohort of round {known + 1}"
        return Rejection("not_in_cohort", detail)
