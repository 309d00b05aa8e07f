"""The chain of delivery checks (services/common/checks/chain.py): order, first refusal wins,
and the dead-letter wording of a `Rejection`."""

from __future__ import annotations

from broker.messages import Heartbeat
from broker.rejection import Rejection
from broker.transport import Delivery
from services.common.checks.chain import Check, first_rejection

DELIVERY = Delivery(b"", "j.control", "j", 1)
BEAT = Heartbeat("j", "a", "m", 0)


def test_the_first_rejection_in_order_wins_and_later_checks_are_not_asked() -> None:
    asked: list[str] = []

    def passes(delivery: Delivery, message: Heartbeat) -> Rejection | None:
        asked.append("passes")
        return None

    def refuses(code: str) -> Check[Heartbeat]:
        def check(delivery: Delivery, message: Heartbeat) -> Rejection | None:
            asked.append(code)
            return Rejection(code, f"{message.client} refused")

        return check

    chain = (passes, refuses("first"), refuses("second"))
    assert first_rejection(chain, DELIVERY, BEAT) == Rejection("first", "a refused")
    assert asked == ["passes", "first"]


def test_an_empty_chain_or_one_of_passing_checks_passes() -> None:
    assert first_rejection((), DELIVERY, BEAT) is None
    assert first_rejection((lambda d, m: None,) * 3, DELIVERY, BEAT) is None


def test_the_reason_is_the_code_then_the_detail() -> None:
    assert Rejection("bad_shape", "rows 0").reason == "bad_shape: rows 0"
