"""The worker's pure pieces: the step barrier, validation, device choice, replica bookkeeping."""

from __future__ import annotations

import logging
from collections.abc import Callable

import pytest
import torch

from broker.memory_store import InMemoryWeightStore
from broker.messages import RoundStart, SmashedBatch
from broker.rejection import Rejection
from broker.transport import Delivery
from services.common.checks.addressing import SameJob, SameShard
from services.common.checks.membership import InCohort
from services.common.checks.sender import ClientIdShape, NamesClient
from services.common.jobmodel import job_hyper, job_model
from tests.unit.test_worker_support import CUT, make_settings, seed_version
from workers.barrier import StepBarrier
from workers.replica import RECENT_SEQS, Replica, open_replica, pick_device
from workers.shard_checks import (
    BatchContent,
    CohortMember,
    KnownClient,
    ShardExpectations,
    parse_cohort,
)

COHORT = {"a": 10, "b": 20, "c": 30}


def test_barrier_waits_for_every_running_client() -> None:
    barrier: StepBarrier[str] = StepBarrier(timeout_s=5.0)
    progress: dict[str, tuple[int, int]] = {}
    barrier.add("a", "a0", now=0.0)
    barrier.add("c", "c0", now=0.5)
    assert not barrier.ready(COHORT, progress)
    barrier.add("b", "b0", now=1.0)
    assert barrier.ready(COHORT, progress)
    assert barrier.take(COHORT, progress) == ["a0", "b0", "c0"]  # cohort order
    assert len(barrier) == 0 and not barrier.dropped


def test_barrier_stops_expecting_clients_that_finished() -> None:
    barrier: StepBarrier[str] = StepBarrier(timeout_s=5.0)
    progress = {"a": (1, 3), "b": (0, 1), "c": (1, 3)}  # b took its only step already
    barrier.add("a", "a2", now=0.0)
    assert not barrier.ready(COHORT, progress)
    barrier.add("c", "c2", now=0.0)
    assert barrier.ready(COHORT, progress)


def test_barrier_timeout_drops_the_missing_for_the_rest_of_the_round() -> None:
    barrier: StepBarrier[str] = StepBarrier(timeout_s=5.0)
    progress: dict[str, tuple[int, int]] = {}
    barrier.add("a", "a0", now=10.0)
    barrier.add("b", "b0", now=12.0)
    assert barrier.deadline() == 15.0
    assert not barrier.expired(14.9) and barrier.expired(15.0)
    assert barrier.take(COHORT, progress) == ["a0", "b0"]
    assert barrier.dropped == {"c"}
    barrier.add("a", "a1", now=16.0)
    barrier.add("b", "b1", now=16.0)
    assert barrier.ready(COHORT, progress)  # no more waiting for c
    barrier.take(COHORT, progress)
    barrier.add("c", "c0", now=20.0)  # c shows up late: served, alone if need be
    assert barrier.ready({"c": 30}, progress)
    barrier.new_round()
    assert not barrier.dropped


def test_barrier_serves_outsiders_with_the_next_step() -> None:
    barrier: StepBarrier[str] = StepBarrier(timeout_s=5.0)
    barrier.add("x", "x0", now=0.0)  # not in the cohort (another round's batch)
    assert not barrier.ready({"a": 1}, {})
    barrier.add("a", "a0", now=0.0)
    assert barrier.take({"a": 1}, {}) == ["a0", "x0"]


def batch(**overrides: object) -> SmashedBatch:
    fields: dict[str, object] = {
        "job": "j", "client": "a", "message_id": "m", "version": 1, "seq": 0, "shard": 0,
        "round": 0, "step": 0, "activations": torch.zeros(4, 10, 12, 12),
        "labels": torch.zeros(4, dtype=torch.int64),
    }  # fmt: skip
    fields.update(overrides)
    return SmashedBatch(**fields)  # type: ignore[arg-type]


WANT = ShardExpectations(job="j", shard=0, cut_shape=(10, 12, 12), num_classes=10)
DELIVERY = Delivery(body=b"", queue="q", routing_key="q", tag=1)


def check_batch(message: SmashedBatch, want: ShardExpectations) -> Rejection | None:
    """The worker's checks of a batch alone, in the chain's order (`ShardRunner._chains`)."""
    checks = (
        SameJob(want.job),
        SameShard(want.shard),
        NamesClient("bad_client"),
        ClientIdShape("bad_client"),
        BatchContent(want),
    )
    return next((p for c in checks if (p := c(DELIVERY, message)) is not None), None)


class Cohort:
    def __init__(self, cohort_round: int, cohort: dict[str, int]) -> None:
        self.cohort_round, self.cohort = cohort_round, cohort


@pytest.mark.parametrize(
    ("overrides", "code"),
    [
        ({}, None),
        ({"job": "k"}, "wrong_job"),
        ({"shard": 1}, "wrong_shard"),
        ({"client": ""}, "bad_client"),
        ({"activations": torch.zeros(4, 10, 12, 11)}, "bad_shape"),
        ({"activations": torch.zeros(0, 10, 12, 12), "labels": torch.zeros(0)}, "bad_shape"),
        ({"labels": torch.tensor([0, 1, 2, -1])}, "bad_labels"),
        ({"labels": torch.tensor([0, 1, 2, 10])}, "bad_labels"),
    ],
)
def test_batch_checks(overrides: dict[str, object], code: str | None) -> None:
    problem = check_batch(batch(**overrides), WANT)
    assert (problem.code if problem else None) == code


def test_membership_applies_to_the_round_of_the_known_cohort_only() -> None:
    in_cohort = InCohort(Cohort(0, COHORT))
    assert in_cohort(DELIVERY, batch(client="z")) is not None
    assert in_cohort(DELIVERY, batch(client="z", round=1)) is None
    assert in_cohort(DELIVERY, batch(client="a")) is None


class Known(Cohort):
    def __init__(self, cohort_round: int, cohort: dict[str, int], seqs: dict[str, int]) -> None:
        super().__init__(cohort_round, cohort)
        self.seqs = seqs


def test_a_cohort_member_is_in_cohort_then_known_in_one_check() -> None:
    members = {"m"}
    known = Known(0, COHORT, {"s": 3})
    one = CohortMember(known, members.__contains__)
    both = (InCohort(known), KnownClient(known, members.__contains__))
    for message in (
        batch(client="a"),
        batch(client="z"),
        batch(client="z", round=1),
        batch(client="s", round=1),
        batch(client="m", round=1),
    ):
        apart = next((p for c in both if (p := c(DELIVERY, message)) is not None), None)
        assert one(DELIVERY, message) == apart
    assert one(DELIVERY, batch(client="z")) == Rejection(
        "not_in_cohort", "client 'z' is not in the cohort of round 1"
    )
    assert one(DELIVERY, batch(client="z", round=1)) == Rejection(
        "unknown_client", "client 'z' is not a member of the job"
    )


def test_cohort_parsing_rejects_unusable_sample_counts() -> None:
    start = RoundStart("j", "", "m", 1, 0, 0, {"a": 10, "b": 20})
    assert parse_cohort(start) == ({"a": 10, "b": 20}, None)
    for bad in ({"a": 0}, {"a": "ten"}, {"a": True}, {"": 3}):
        cohort, problem = parse_cohort(RoundStart("j", "", "m", 1, 0, 0, bad))
        assert cohort is None and problem is not None and problem.code == "bad_cohort"


def test_device_choice() -> None:
    assert pick_device("auto", cuda_available=lambda: False).type == "cpu"
    assert pick_device("auto", cuda_available=lambda: True).type == "cuda"
    assert pick_device("cpu", cuda_available=lambda: True).type == "cpu"
    with pytest.raises(ValueError, match="no CUDA"):
        pick_device("cuda", cuda_available=lambda: False)


def test_replica_checkpoint_round_trip_and_hand_in(job: str) -> None:
    settings = make_settings(job)
    store = InMemoryWeightStore()
    template = job_model(settings)
    hyper = job_hyper(settings)

    def make() -> Replica:
        return Replica(0, template, CUT, hyper.server_optimizer, torch.device("cpu"))

    assert open_replica(store, job, make, logging.getLogger()) is None  # nothing published yet
    seed_version(store, settings)
    replica = open_replica(store, job, make, logging.getLogger())
    assert replica is not None and replica.version == 1
    replica.begin_round(0, {"a": 10})
    replica.record("a", seq=4, step=0, steps=2, rows=8)
    assert replica.end_round(0) and not replica.end_round(0)
    store.save_checkpoint(job, replica.checkpoint())

    resumed = open_replica(store, job, make, logging.getLogger())
    assert resumed is not None
    saved = store.load_checkpoint(job, 0)
    assert saved is not None and saved.meta["round_samples"] == 8 and saved.meta["handed_in"]
    # The round's samples were handed in: the resumed replica counts the next round afresh.
    assert (resumed.applied, resumed.round, resumed.round_samples) == (1, 0, 0)
    assert resumed.seqs == {"a": 4} and resumed.cohort == {"a": 10}
    assert resumed.progress == {"a": (0, 2)}
    for name, tensor in resumed.server.state_dict().items():
        assert torch.equal(tensor, replica.server.state_dict()[name])


def published(job: str) -> tuple[InMemoryWeightStore, Callable[[], Replica]]:
    """A store with version 1 of the job's model, and how to make shard 0's replica."""
    settings = make_settings(job)
    store = InMemoryWeightStore()
    template, hyper = job_model(settings), job_hyper(settings)
    seed_version(store, settings)
    return store, lambda: Replica(0, template, CUT, hyper.server_optimizer, torch.device("cpu"))


def test_a_handed_back_batch_behind_newer_ones_is_applied_and_a_copy_never(job: str) -> None:
    # A worker that lost the shard held seqs 11 and 12; on a quorum queue they may come back
    # behind 13 and 14. They are still to apply; copies of what is applied are not, and the
    # window and its floor survive a checkpoint.
    store, make = published(job)
    replica = open_replica(store, job, make, logging.getLogger())
    assert replica is not None
    for seq in (10, 13, 14):
        assert not replica.applied_already("a", seq)
        replica.record("a", seq=seq, step=0, steps=20, rows=8)
    assert replica.applied_already("a", 13) and replica.applied_already("a", 10)
    assert not replica.applied_already("a", 11) and not replica.applied_already("b", 11)
    replica.record("a", seq=11, step=0, steps=20, rows=8)
    assert replica.applied_already("a", 11) and not replica.applied_already("a", 12)
    assert replica.seqs == {"a": 14}  # the highest, whatever the order

    store.save_checkpoint(job, replica.checkpoint())
    resumed = open_replica(store, job, make, logging.getLogger())
    assert resumed is not None
    assert not resumed.applied_already("a", 12) and resumed.applied_already("a", 11)

    # Past the window, the oldest seqs fold into the floor: all at or below it count applied.
    for seq in range(100, 100 + RECENT_SEQS):
        resumed.record("a", seq=seq, step=0, steps=200, rows=8)
    assert resumed.floors == {"a": 14} and resumed.applied_already("a", 12)
    assert not resumed.applied_already("a", 100 + RECENT_SEQS)


def test_a_checkpoint_from_before_windows_counts_every_seq_up_to_the_highest(job: str) -> None:
    store, make = published(job)
    replica = open_replica(store, job, make, logging.getLogger())
    assert replica is not None
    replica.record("a", seq=7, step=0, steps=2, rows=8)
    old = replica.checkpoint()
    old.meta.pop("floors")
    old.meta.pop("recent")
    store.save_checkpoint(job, old)
    resumed = open_replica(store, job, make, logging.getLogger())
    assert resumed is not None
    assert resumed.applied_already("a", 5) and resumed.applied_already("a", 7)
    assert not resumed.applied_already("a", 8)
