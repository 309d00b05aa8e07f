"""Whether a round marker (RoundStart, RoundEnd) names a version that can have that round."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from broker.rejection import Rejection
from broker.transport import Delivery


class RoundMarker(Protocol):
    @property
    def round(self) -> int: ...

    @property
    def version(self) -> int: ...


@dataclass(frozen=True, slots=True)
class MarkerVersion:
    """Round markers come from the aggregator: round r belongs to version r + 1, and only a
    version already published can have a round (a marker from the future is forged).
    `published` reads the job's current version (asked only of a marker that names a round
    its version can have)."""

    published: Callable[[], int]

    def __call__(self, delivery: Delivery, message: RoundMarker, /) -> Rejection | None:
        kind = type(message).__name__
        if message.round >= message.version:
            detail = (
                f"{kind} of round {message.round} names version {message.version}; "
                "round r trains version r + 1"
            )
            return Rejection("bad_marker", detail)
        current = self.published()
        if message.version > current:
            detail = f"{kind} names version {message.version}, beyond the published {current}"
            return Rejection("bad_marker", detail)
        return None
