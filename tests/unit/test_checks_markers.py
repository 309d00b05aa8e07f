"""The round marker's version check (services/common/checks/markers.py)."""

from __future__ import annotations

from broker.messages import RoundEnd, RoundStart
from broker.rejection import Rejection
from broker.transport import Delivery
from services.common.checks.markers import MarkerVersion

DELIVERY = Delivery(b"", "j.shard.0", "0", 1)


def test_a_marker_names_its_rounds_version_and_no_unpublished_one() -> None:
    reads: list[int] = []

    def published() -> int:
        reads.append(3)
        return 3

    check = MarkerVersion(published)
    assert check(DELIVERY, RoundStart("j", "", "m", 3, 2, 0, {"a": 1})) is None
    assert check(DELIVERY, RoundEnd("j", "", "m", 1, 0, 0)) is None  # an old round's
    assert check(DELIVERY, RoundEnd("j", "", "m", 2, 2, 0)) == Rejection(
        "bad_marker", "RoundEnd of round 2 names version 2; round r trains version r + 1"
    )
    assert len(reads) == 2  # a marker wrong in itself costs no read of the version
    assert check(DELIVERY, RoundStart("j", "", "m", 9, 8, 0, {"a": 1})) == Rejection(
        "bad_marker", "RoundStart names version 9, beyond the published 3"
    )
