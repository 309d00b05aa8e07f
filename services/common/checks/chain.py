"""A delivery's checks as an ordered chain (dramatiq's middleware list, typed).

A check is any callable `(delivery, message) -> Rejection | None`: a small frozen class holding
what it compares against (the job, the member records), or a plain function. A role keeps one
tuple of checks per message type, cheapest first and store reads last, and runs it with
`first_rejection` before the handler, which then does only the work. A check costs one call
when it passes: no wrapper sits between the chain and the checks.

Each role words the dead letter itself from a `Rejection`: the worker as `code: detail`, the
aggregator and the coordinator with the detail alone.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol, TypeVar

from broker.rejection import Rejection
from broker.transport import Delivery

M = TypeVar("M")
M_contra = TypeVar("M_contra", contravariant=True)


class Check(Protocol[M_contra]):
    def __call__(self, delivery: Delivery, message: M_contra, /) -> Rejection | None:
        """Why `message` (come as `delivery`) is refused; None when this check passes it."""


def first_rejection(checks: Iterable[Check[M]], delivery: Delivery, message: M) -> Rejection | None:
    """The first check's rejection, in order; None when every check passes the message."""
    for check in checks:
        rejection = check(delivery, message)
        if rejection is not None:
            return rejection
    return None
