"""Whether a message is on the right queue: its type, its job, its shard."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from broker.rejection import Rejection
from broker.transport import Delivery


class Addressed(Protocol):
    @property
    def job(self) -> str: ...


class OnShard(Protocol):
    @property
    def shard(self) -> int: ...


def wrong_type(message: object, where: str) -> Rejection:
    """The rejection of a message of a type that `where` (a queue) does not take."""
    return Rejection("wrong_type", f"{type(message).__name__} does not belong on {where}")


@dataclass(frozen=True, slots=True)
class SameJob:
    """A message of another job is refused (misrouted, or forged)."""

    job: str
    # The role's words: `{got}` is the message's job, `{want}` this one.
    says: str = "job {got!r} on a queue of job {want!r}"

    def __call__(self, delivery: Delivery, message: Addressed, /) -> Rejection | None:
        if message.job == self.job:
            return None
        return Rejection("wrong_job", self.says.format(got=message.job, want=self.job))


@dataclass(frozen=True, slots=True)
class SameShard:
    """A message naming another shard than the queue's is refused."""

    shard: int

    def __call__(self, delivery: Delivery, message: OnShard, /) -> Rejection | None:
        if message.shard == self.shard:
            return None
        detail = f"shard {message.shard} on the queue of shard {self.shard}"
        return Rejection("wrong_shard", detail)
