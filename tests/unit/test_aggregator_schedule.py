"""The aggregator's stream of the run's schedule record (issue 36): one `Folded` per version
published, its updates in fold order and the digest of exactly what was published, for both
clocks; and the members' accepted RoundDropped notices."""

from __future__ import annotations

from broker.store import SERVER_PART, BlobRef
from services.aggregator.aggregator import Aggregator
from services.algorithms.staleness import StalenessRule
from services.common.schedule import (
    AGGREGATOR_STREAM,
    Folded,
    FoldedUpdate,
    MemberEvent,
    decode,
    weights_digest,
)
from services.report.records import ListSink
from tests.unit.test_aggregator import Job
from tests.unit.test_aggregator_peers import make_settings, running
from tests.unit.test_async_aggregator import SAMPLES, AsyncJob


def published_digest(job: Job | AsyncJob, name: str, version: int) -> str:
    """The digest of the version as the store hands it out (not the aggregator's copy)."""
    store = job.store
    blobs = {
        ref: store.read_blob(name, version, ref) for ref in store.manifest(name, version).entries
    }
    return weights_digest(blobs)


def folds(job: Job | AsyncJob, name: str) -> list[Folded]:
    entries = [decode(line) for line in job.store.read_schedule(name).get(AGGREGATOR_STREAM, [])]
    return [e for e in entries if isinstance(e, Folded)]


def test_a_sync_job_records_one_fold_per_version(job: str) -> None:
    j = Job(make_settings(job))
    aggregator = Aggregator(j.settings, j.backends, sink=ListSink())
    j.run(aggregator)

    found = folds(j, job)
    assert [(f.version, f.round) for f in found] == [(2, 0), (3, 1)]
    for f in found:
        # The cohort's updates in the order the fold took them (sorted by client), fresh.
        assert [u.client for u in f.updates] == ["a", "b", "c"]
        assert all(u.base_version == f.version - 1 and u.staleness == 0 for u in f.updates)
        assert all(u.weight == 1.0 and u.samples > 0 for u in f.updates)
        # The one shard's replica, with its checkpoint's applied count.
        checkpoint_shards = [shard for shard, _ in f.replicas]
        assert checkpoint_shards == [0] and all(n >= 0 for _, n in f.replicas)
        assert f.digest == published_digest(j, job, f.version)
    assert found[0].digest != found[1].digest
    assert [f.cohort for f in found] == [("a", "b", "c")] * 2
    # The record is on the store when the version is: nothing is left buffered.
    assert BlobRef(SERVER_PART) in j.store.manifest(job, 3).entries


def test_an_async_job_records_each_fold_with_staleness_and_weights(job: str) -> None:
    aj = AsyncJob(job)
    try:
        with running([aj.run]):
            aj.send("a", 1, 1.0)
            aj.replies("a", 1)
            aj.send("b", 1, 4.0)
            aj.wait_version(2)
            aj.send("c", 1, 2.0)  # one version behind
            aj.send("a", 2, 1.0, round_=1)
            aj.wait_version(3)
            # Exactly the versions published so far are recorded, each as it was published.
            found = folds(aj, job)
            assert [f.version for f in found] == aj.store.versions(job)[1:]
    finally:
        aj.broker.close()
    s = StalenessRule("polynomial", a=0.5).weight(1)
    first, second = found[:2]
    assert first.updates == (
        FoldedUpdate("a", 1, 0, 1.0, float(SAMPLES["a"])),
        FoldedUpdate("b", 1, 0, 1.0, float(SAMPLES["b"])),
    )
    assert [(u.client, u.base_version, u.staleness) for u in second.updates] == [
        ("c", 1, 1),
        ("a", 2, 0),
    ]
    assert second.updates[0].weight == s and second.updates[1].weight == 1.0
    for f in (first, second):
        assert f.replicas == ()  # fedavg: no server side
        assert f.digest == published_digest(aj, job, f.version)


def test_an_accepted_round_dropped_is_recorded(job: str) -> None:
    from broker.codec import encode
    from broker.messages import ABORTED, RoundDropped, new_message_id
    from broker.topology import CONTROL_EXCHANGE, updates_routing_key

    aj = AsyncJob(job)
    try:
        with running([aj.run]):
            drop = RoundDropped(job, "b", new_message_id(), 1, 0, ABORTED)
            aj.broker.publish(CONTROL_EXCHANGE, updates_routing_key(job), encode(drop))
            aj.send("a", 1, 1.0)
            aj.send("c", 1, 1.0)
            aj.wait_version(2)
    finally:
        aj.broker.close()
    entries = [decode(line) for line in aj.store.read_schedule(job)[AGGREGATOR_STREAM]]
    dropped = [e for e in entries if isinstance(e, MemberEvent)]
    assert dropped == [MemberEvent("dropped_round", "b", 0)]
    # Written with the fold after it, before it in the stream.
    assert entries.index(dropped[0]) < entries.index(folds(aj, job)[0])


def test_a_replayed_cohort_takes_the_place_of_the_draw(job: str) -> None:
    # `splitmq replay` hands the aggregator the run's cohorts: round 2's without "b" (as if it
    # had left), though all three are members and the draw would take them all.
    j = Job(make_settings(job))
    aggregator = Aggregator(
        j.settings, j.backends, sink=ListSink(), cohorts={1: ("a", "c", "gone")}
    )
    j.run(aggregator)

    first, second = folds(j, job)
    assert first.cohort == ("a", "b", "c")
    assert second.cohort == ("a", "c")  # a recorded member that is not live is left out
    assert [u.client for u in second.updates] == ["a", "c"]
