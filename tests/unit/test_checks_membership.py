"""Membership and cohort checks (services/common/checks/membership.py), with hand-built state."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from broker.messages import Heartbeat, SmashedBatch
from broker.rejection import Rejection
from broker.transport import Delivery
from services.common.checks.membership import InCohort, Membership

DELIVERY = Delivery(b"", "q", "k", 1)


def test_a_strangers_message_is_refused_with_the_roles_code() -> None:
    asked: list[str] = []

    def is_member(client: str) -> bool:
        asked.append(client)
        return client == "a"

    check = Membership(is_member, "unknown_client")
    assert check(DELIVERY, Heartbeat("j", "a", "m", 0)) is None
    assert check(DELIVERY, Heartbeat("j", "ghost", "m", 0)) == Rejection(
        "unknown_client", "client 'ghost' is not a member of the job"
    )
    assert asked == ["a", "ghost"]


@dataclass
class Round:
    cohort_round: int = -1
    cohort: Mapping[str, int] = field(default_factory=dict)


def batch(client: str, round_: int) -> SmashedBatch:
    return SmashedBatch("j", client, "m", 1, 5, 0, round_, 0, torch.zeros(1, 2), torch.zeros(1))


def test_a_batch_of_the_known_round_must_come_from_its_cohort() -> None:
    state = Round()
    check = InCohort(state)
    assert check(DELIVERY, batch("b", 0)) is None  # no cohort known yet
    state.cohort_round, state.cohort = 2, {"a": 10}
    assert check(DELIVERY, batch("a", 2)) is None
    assert check(DELIVERY, batch("b", 1)) is None  # a straggler's: the barrier's business
    assert check(DELIVERY, batch("b", 3)) is None  # a round this shard has not seen start
    assert check(DELIVERY, batch("b", 2)) == Rejection(
        "not_in_cohort", "client 'b' is not in the cohort of round 3"
    )
