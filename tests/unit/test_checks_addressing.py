"""Job, shard and type checks (services/common/checks/addressing.py), with hand-built inputs."""

from __future__ import annotations

import torch

from broker.messages import Heartbeat, RoundEnd, SmashedBatch
from broker.rejection import Rejection
from broker.transport import Delivery
from services.common.checks.addressing import SameJob, SameShard, wrong_type

DELIVERY = Delivery(b"", "j.shard.0", "0", 1)


def batch(job: str = "j", shard: int = 0) -> SmashedBatch:
    return SmashedBatch(job, "a", "m", 1, 5, shard, 0, 0, torch.zeros(1, 2), torch.zeros(1))


def test_a_message_of_another_job_is_refused_in_the_roles_words() -> None:
    assert SameJob("j")(DELIVERY, batch()) is None
    assert SameJob("j")(DELIVERY, batch(job="k")) == Rejection(
        "wrong_job", "job 'k' on a queue of job 'j'"
    )
    says = "message for job {got!r} on job {want!r}'s control queue"
    refused = SameJob("j", says)(DELIVERY, Heartbeat("k", "a", "m", 0))
    assert refused == Rejection("wrong_job", "message for job 'k' on job 'j''s control queue")


def test_a_message_naming_another_shard_is_refused() -> None:
    assert SameShard(0)(DELIVERY, batch()) is None
    assert SameShard(0)(DELIVERY, RoundEnd("j", "", "m", 2, 1, 3)) == Rejection(
        "wrong_shard", "shard 3 on the queue of shard 0"
    )


def test_a_message_of_a_foreign_type_names_its_type_and_the_queue() -> None:
    assert wrong_type(Heartbeat("j", "a", "m", 0), "j.updates") == Rejection(
        "wrong_type", "Heartbeat does not belong on j.updates"
    )
