"""The asynchronous aggregator over the in-memory hub and store, fed update by update: a
version per K buffered updates with the staleness-weighted fold, the newest weights back to
every uploader, too-stale updates refused with a reason the client sees, redeliveries and
strangers, the job's end, and the records' staleness histogram."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from dataclasses import replace

import pytest
import torch
from pydantic import ValidationError
from torch.testing import assert_close

from broker.codec import decode, encode
from broker.messages import (
    Error,
    Message,
    RoundDropped,
    WeightsAssignment,
    WeightsUpdate,
    new_message_id,
)
from broker.store import CLIENT_PART, BlobRef, JobStatus
from broker.topology import CONTROL_EXCHANGE, dead_queue_name, reply_queue_name, updates_routing_key
from broker.transport import REASON_HEADER, Broker
from services.aggregator.aggregator import Aggregator, ensure_initial_version
from services.algorithms.async_fold import is_statistic
from services.algorithms.registry import build_strategy
from services.algorithms.staleness import TOO_STALE, StalenessRule
from services.common.backends import Backends, Embedded
from services.common.supervise import JobFailedError
from services.report.records import ListSink, VersionRecord
from services.report.summary import staleness_histogram
from tests.unit.test_aggregator_peers import (
    WAIT_S,
    add_member,
    declare_all,
    make_settings,
    running,
)

CLIENT = BlobRef(CLIENT_PART)
_LOG = logging.getLogger("test.async.aggregator")
SAMPLES = {"a": 100, "b": 200, "c": 300}


class AsyncJob:
    def __init__(self, job: str, **sections: dict[str, object]) -> None:
        asynchronous = {"buffer_size": 2, "max_staleness": 1, **sections.pop("asynchronous", {})}
        self.settings = make_settings(
            job,
            job={"rounds": 3},
            rounds={"mode": "async"},
            algorithm={"name": "fedavg"},
            asynchronous=asynchronous,
            **sections,
        )
        self.job = job
        self.embedded = Embedded()
        self.store = self.embedded.store
        self.backends = Backends(self.settings.broker, self.settings.store, self.embedded)
        strategy = build_strategy("fedavg")
        ensure_initial_version(self.store, self.settings, strategy, _LOG)
        for i, c in enumerate("abc"):
            add_member(self.store, job, c, samples=SAMPLES[c], partition=i, classes=(i,))
        declare_all(self.backends, self.settings, [*"abc", "stranger"])
        self.broker: Broker = self.backends.open_broker("test")
        self.sink = ListSink()
        self.aggregator = Aggregator(self.settings, self.backends, sink=self.sink)
        self.records: list[VersionRecord] = []
        self.done = threading.Event()

    def run(self, stop: threading.Event) -> None:
        self.records = self.aggregator.run(stop)
        self.done.set()

    def blob(self, version: int) -> dict[str, torch.Tensor]:
        return self.store.read_blob(self.job, version, CLIENT)

    def send(
        self, client: str, base: int, shift: float, *, round_: int = 0, publish: bool = True
    ) -> WeightsUpdate:
        """`client`'s update: version `base`'s client blob with every float moved by `shift`."""
        weights = {
            n: t + shift if t.is_floating_point() else t.clone() for n, t in self.blob(base).items()
        }
        update = WeightsUpdate(
            self.job, client, new_message_id(), base, round_, SAMPLES.get(client, 1), weights, {}
        )
        if publish:
            self.resend(update)
        return update

    def resend(self, update: WeightsUpdate) -> None:
        self.broker.publish(CONTROL_EXCHANGE, updates_routing_key(self.job), encode(update))

    def replies(self, client: str, count: int) -> list[Message]:
        queue = reply_queue_name(self.job, client)
        self.broker.subscribe(queue, prefetch=16)
        out: list[Message] = []
        try:
            while len(out) < count:
                delivery = self.broker.get(WAIT_S)
                assert delivery is not None, f"{client} got {len(out)} of {count} replies"
                self.broker.ack(delivery)
                out.append(decode(delivery.body))
        finally:
            self.broker.unsubscribe(queue)
        return out

    def wait_version(self, version: int) -> None:
        wait = threading.Event()
        for _ in range(int(WAIT_S / 0.02)):
            if self.store.current_version(self.job) >= version:
                return
            wait.wait(0.02)
        pytest.fail(f"version {version} never published")


@pytest.fixture
def aj(job: str) -> Iterator[AsyncJob]:
    j = AsyncJob(job)
    yield j
    j.broker.close()


def assert_moved(got: dict[str, torch.Tensor], base: dict[str, torch.Tensor], by: float) -> None:
    """Every trained tensor moved by `by` (statistics are averaged as uploaded, not replayed)."""
    for name, tensor in got.items():
        if tensor.is_floating_point() and not is_statistic(name):
            assert_close(tensor, base[name] + by, msg=f"{name} not moved by {by}")


def test_versions_fold_k_updates_each_and_answer_every_uploader(aj: AsyncJob) -> None:
    v1 = aj.blob(1)
    with running([aj.run]):
        aj.send("a", 1, 1.0)
        (first,) = aj.replies("a", 1)
        # The buffer is not full yet: a trains on from version 1 at once, nobody waits.
        assert isinstance(first, WeightsAssignment) and first.version == 1
        assert first.participate and first.round == 1 and first.config["mode"] == "async"
        aj.send("b", 1, 4.0)
        (second,) = aj.replies("b", 1)
        assert isinstance(second, WeightsAssignment) and second.version == 2
        # Fresh updates: the sample-weighted average, as in sync mode.
        assert_moved(aj.blob(2), v1, (100 * 1.0 + 200 * 4.0) / 300)

        # c is one version behind (tau = 1), a is fresh: c's change counts (1+1)^-0.5.
        aj.send("c", 1, 2.0)
        aj.send("a", 2, 1.0, round_=1)
        aj.wait_version(3)
        s = StalenessRule("polynomial", a=0.5).weight(1)
        expected = (300 * s * 2.0 + 100 * 1.0) / 400
        assert_moved(aj.blob(3), aj.blob(2), expected)
        name = "blocks.0.bn.running_mean"
        uploaded = (300 * (v1[name] + 2.0) + 100 * (aj.blob(2)[name] + 1.0)) / 400
        assert_close(aj.blob(3)[name], uploaded)
        meta = aj.store.manifest(aj.job, 3).meta
        assert meta["mode"] == "async" and meta["staleness"] == "1,0"
        assert meta["participants"] == "c,a"
        assert [m.version for m in aj.replies("c", 1)] == [2]  # type: ignore[attr-defined]
        assert [m.version for m in aj.replies("a", 1)] == [3]  # type: ignore[attr-defined]


def test_a_too_stale_update_is_refused_with_a_reason_and_the_newest_weights(
    aj: AsyncJob,
) -> None:
    with running([aj.run]):
        aj.send("a", 1, 1.0)
        aj.send("b", 1, 1.0)
        aj.wait_version(2)
        aj.send("a", 2, 1.0)
        aj.send("b", 2, 1.0)
        aj.wait_version(3)
        aj.replies("a", 2)
        stale = aj.send("c", 1, 5.0)  # two versions behind, max_staleness is 1
        error, assignment = aj.replies("c", 2)
        assert isinstance(error, Error) and error.code == TOO_STALE
        assert error.ref_message_id == stale.message_id
        assert "update based on version 1" in error.reason and "max 1" in error.reason
        assert isinstance(assignment, WeightsAssignment) and assignment.version == 3
        # Nothing of it went into a version: the next one is a's and b's alone.
        aj.send("a", 3, 1.0)
        aj.send("b", 3, 1.0)
        assert aj.done.wait(WAIT_S)
    assert aj.store.current_version(aj.job) == 4
    assert aj.aggregator.stats.too_stale == 1
    assert aj.aggregator.stats.folded == 6
    assert [r.extra["too_stale"] for r in aj.records] == [0.0, 0.0, 1.0]
    assert "c" not in aj.store.manifest(aj.job, 4).meta["participants"]
    histogram = staleness_histogram(aj.records)
    assert histogram is not None and histogram.refused == 1
    assert sum(histogram.folded.values()) == 6


def test_redeliveries_strangers_and_updates_from_the_future_are_never_folded(
    aj: AsyncJob,
) -> None:
    with running([aj.run]):
        first = aj.send("a", 1, 1.0)
        aj.replies("a", 1)
        aj.resend(first)  # a redelivery of a buffered update
        aj.send("stranger", 1, 9.0)
        future = replace(aj.send("b", 1, 0.0, publish=False), version=5, message_id="f")
        aj.resend(future)  # based on a version that does not exist yet
        aj.send("c", 1, 2.0)
        aj.wait_version(2)
    assert aj.store.manifest(aj.job, 2).meta["participants"] == "a,c"
    assert aj.aggregator.inbox_stats.duplicates == 1
    dead = dead_reasons(aj)
    assert any("'stranger' is not a member" in r for r in dead), dead
    assert any("beyond the current 1" in r for r in dead), dead


def dead_reasons(aj: AsyncJob) -> list[str]:
    queue = dead_queue_name(aj.job)
    aj.broker.subscribe(queue, prefetch=16)
    out: list[str] = []
    try:
        while (delivery := aj.broker.get(0.2)) is not None:
            aj.broker.ack(delivery)
            out.append(str(delivery.headers.get(REASON_HEADER, "")))
    finally:
        aj.broker.unsubscribe(queue)
    return out


def test_the_job_ends_after_its_versions_and_dismisses_the_members(aj: AsyncJob) -> None:
    with running([aj.run]):
        for version in (1, 2, 3):
            aj.send("a", version, 0.5)
            aj.send("b", version, 0.5)
            aj.wait_version(version + 1)
        assert aj.done.wait(WAIT_S)
    assert aj.sink.status == "finished"
    assert aj.store.job_status(aj.job) == JobStatus("finished")
    assert [r.version for r in aj.records] == [2, 3, 4]
    assert all(r.extra["staleness.0"] == 2.0 for r in aj.records)
    finished = [m for m in aj.replies("c", 1) if isinstance(m, WeightsAssignment)]
    assert finished and finished[0].config.get("finished") is True


def test_an_async_job_of_an_algorithm_with_a_step_barrier_is_refused(job: str) -> None:
    with pytest.raises(ValidationError, match="minibatch_sfl stays synchronous"):
        make_settings(job, algorithm={"name": "minibatch_sfl"}, rounds={"mode": "async"})
    # A strategy object with a barrier (e.g. a custom one) is refused by the aggregator.
    settings = make_settings(job, algorithm={"name": "sfl_v2"}, rounds={"mode": "async"})
    assert settings.buffer_size == 3  # K = 4 by default, capped at the 3 client slots
    backends = Backends(settings.broker, settings.store, Embedded())
    with pytest.raises(ValueError, match="barrier"):
        Aggregator(settings, backends, sink=ListSink(), strategy=build_strategy("minibatch_sfl"))


def test_drops_are_counted_and_enough_in_a_row_fail_the_job(job: str) -> None:
    # One fruitless local round per client (3 clients) in a row fails the job.
    aj = AsyncJob(job, asynchronous={"max_fruitless_per_client": 1})
    failures: list[JobFailedError] = []

    def aggregate(stop: threading.Event) -> None:
        try:
            aj.aggregator.run(stop)
        except JobFailedError as exc:
            failures.append(exc)
        aj.done.set()

    def drop(
        client: str, reason: str = "non_finite", message_id: str = "", version: int = 1
    ) -> None:
        notice = RoundDropped(aj.job, client, message_id or new_message_id(), version, 0, reason)
        aj.broker.publish(CONTROL_EXCHANGE, updates_routing_key(aj.job), encode(notice))

    try:
        with running([aggregate]):
            drop("a")
            drop("stranger")  # not a member: dead-lettered, not counted
            aj.send("a", 1, 1.0)  # buffered: the count starts again
            aj.replies("a", 1)
            drop("b", "aborted", message_id="once")
            drop("b", "aborted", message_id="once")  # a redelivery: not counted twice
            drop("c")
            drop("a", version=999)  # of a version not published: junk, dead-lettered, not counted
            assert not aj.done.wait(0.3)  # two in a row so far
            drop("a")
            assert aj.done.wait(WAIT_S)
        reason = (
            "3 local rounds in a row came to nothing, with no update buffered in between; "
            "reasons: aborted ×1, non_finite ×2"
        )
        assert [str(f) for f in failures] == [reason]
        assert aj.sink.status == f"failed: {reason}"
        assert aj.store.job_status(aj.job) == JobStatus("failed", reason)
        assert aj.aggregator.inbox_stats.drops == 4
        assert aj.aggregator.inbox_stats.duplicates == 1
        reasons = dead_reasons(aj)
        assert any("'stranger' is not a member" in r for r in reasons)
        assert any("based on version 999, beyond the current" in r for r in reasons)
        # Every member is dismissed with the status, as in sync mode.
        last = [m for m in aj.replies("c", 1) if isinstance(m, WeightsAssignment)]
        assert last and last[-1].config["status"] == f"failed: {reason}"
    finally:
        aj.broker.close()
