"""A Join that arrives after the job's last version: dismissed, not welcomed.

The aggregator dismisses the members it finds after publishing the last version; a client
whose Join is processed later (a slow start on a busy machine) used to be welcomed into a job
with no round left and waited forever.
"""

from __future__ import annotations

from broker.messages import WeightsAssignment, Welcome
from broker.store import BlobRef, JobStatus
from services.common.membership import client_members
from services.config.root import Settings
from tests.unit.test_aggregator_peers import make_settings
from tests.unit.test_coordinator import Desk


def settings(job: str, rounds: int) -> Settings:
    return make_settings(job, job={"rounds": rounds}, clients={"count": 3, "min_to_start": 1})


def publish_next(desk: Desk) -> int:
    """A new version with the same weights as the current one."""
    current = desk.store.current_version(desk.job)
    refs: list[BlobRef] = list(desk.store.manifest(desk.job, current).entries)
    blobs = {ref: desk.store.read_blob(desk.job, current, ref) for ref in refs}
    return desk.store.publish_version(desk.job, current, blobs)


def test_a_join_after_the_last_round_is_told_the_job_finished(job: str) -> None:
    desk = Desk(settings(job, rounds=1))
    with desk.serving():
        desk.join("early")
        assert isinstance(desk.reply("early"), Welcome)
        assert publish_next(desk) == 2  # round 0 closed: the job's only round
        desk.join("late", index="1")
        reply = desk.reply("late")

    assert isinstance(reply, WeightsAssignment), reply
    expected = {"finished": True, "status": "finished"}  # as the aggregator's dismissal says
    assert (reply.participate, reply.config, reply.version) == (False, expected, 2)
    # Not a member: nothing waits for it, and its slot is not held.
    assert set(client_members(desk.store, job)) == {"early"}
    assert desk.coordinator.stats.joined == 1


def test_a_join_before_the_last_round_closed_is_welcomed(job: str) -> None:
    desk = Desk(settings(job, rounds=2))
    with desk.serving():
        publish_next(desk)  # round 0 of 2 closed: round 1 is still to come
        desk.join("late")
        reply = desk.reply("late")

    assert isinstance(reply, Welcome), reply
    assert (reply.version, reply.round) == (2, 1)
    assert set(client_members(desk.store, job)) == {"late"}


def test_a_join_after_the_job_failed_is_told_why_even_when_every_slot_is_taken(job: str) -> None:
    desk = Desk(settings(job, rounds=5))
    with desk.serving():
        for i, client in enumerate(("a", "b", "c")):  # clients.count = 3: the job is full
            desk.join(client, index=str(i))
            assert isinstance(desk.reply(client), Welcome)
        reason = "2 consecutive attempts at round 0 without one valid update"
        desk.store.set_job_status(job, JobStatus("failed", reason))
        desk.join("late")
        reply = desk.reply("late")
        desk.join("a")  # a member re-joining (a restarted client) is told the same
        again = desk.reply("a")

    for told in (reply, again):
        assert isinstance(told, WeightsAssignment), told
        assert (told.participate, told.version) == (False, 1)
        assert told.config == {"finished": True, "status": f"failed: {reason}"}
    assert "late" not in client_members(desk.store, job)
    assert desk.coordinator.stats.refused == 0
