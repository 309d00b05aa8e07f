"""The aggregator driven over the in-memory hub and store by scripted clients and a scripted
worker: whole jobs, stragglers, late and malformed updates, reopened rounds, racing versions."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping

import pytest
import torch

from broker.codec import encode
from broker.errors import VersionConflictError
from broker.memory_store import InMemoryWeightStore
from broker.messages import Error, WeightsAssignment, WeightsUpdate
from broker.store import AUX_PART, CLIENT_PART, SERVER_PART, BlobRef, Weights
from broker.topology import dead_queue_name
from broker.transport import REASON_HEADER
from services.aggregator.aggregator import Aggregator, ensure_initial_version
from services.aggregator.evaluation import build_evaluator, evaluate
from services.aggregator.round_gate import sample_cohort
from services.algorithms.base import full_model_weights
from services.algorithms.registry import build_strategy
from services.common.backends import Backends, Embedded
from services.common.membership import member_id
from services.config.root import Settings
from services.data.loaders import load_dataset
from services.report.records import ListSink, VersionRecord
from tests.unit.test_aggregator_peers import (
    WAIT_S,
    FakeClient,
    FakeWorker,
    ManualClock,
    add_member,
    client_loop,
    declare_all,
    filled,
    make_settings,
    running,
    worker_loop,
)

SAMPLES = {"a": 100, "b": 200, "c": 300, "d": 400}
CLIENT = BlobRef(CLIENT_PART)
SERVER = BlobRef(SERVER_PART)
AUX = BlobRef(AUX_PART)
LOG = logging.getLogger("test.aggregator")


def wait_until(predicate: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def client_value(index: int) -> Callable[[int], float]:
    """Client `index` fills its round-r update with index + 1 + 10 r."""
    return lambda r: float(index + 1 + 10 * r)


class Job:
    """One job over an in-memory hub: settings, version 1, members and fake peers."""

    def __init__(
        self,
        settings: Settings,
        clients: str = "abc",
        *,
        store: InMemoryWeightStore | None = None,
        members: str | None = None,
    ) -> None:
        self.settings = settings
        self.name = settings.job.name
        self.embedded = Embedded() if store is None else Embedded(store=store)
        self.store = self.embedded.store
        self.backends = Backends(settings.broker, settings.store, self.embedded)
        strategy = build_strategy(settings.algorithm.name, settings.algorithm.params())
        ensure_initial_version(self.store, settings, strategy, LOG)
        for i, c in enumerate(clients if members is None else members):
            add_member(self.store, self.name, c, samples=SAMPLES[c], partition=i, classes=(i,))
        declare_all(self.backends, settings, list(clients))
        self.clients = {
            c: FakeClient(c, SAMPLES[c], client_value(i)) for i, c in enumerate(clients)
        }
        self.worker = FakeWorker(self.blob(1, SERVER), lambda r: 50.0 + r)

    def blob(self, version: int, ref: BlobRef) -> dict[str, torch.Tensor]:
        return self.store.read_blob(self.name, version, ref)

    def run(
        self, aggregator: Aggregator, during: Callable[[], None] | None = None
    ) -> list[VersionRecord]:
        result: list[list[VersionRecord]] = []
        done = threading.Event()

        def aggregate(stop: threading.Event) -> None:
            result.append(aggregator.run(stop))
            done.set()

        peers = [client_loop(self.backends, self.name, f) for f in self.clients.values()]
        peers.append(worker_loop(self.backends, self.name, self.settings.shards, self.worker))
        with running([*peers, aggregate]):
            if during is not None:
                during()
            assert done.wait(WAIT_S), "the aggregator did not finish the job"
        return result[0]


def assert_all(weights: dict[str, torch.Tensor], value: float) -> None:
    """Every floating tensor holds `value` (integer buffers are counters: they take the max)."""
    floats = {n: t for n, t in weights.items() if t.is_floating_point()}
    assert floats, "no floating tensors"
    for name, tensor in floats.items():
        expected = torch.full_like(tensor, value)
        torch.testing.assert_close(tensor, expected, msg=f"{name} is not {value}")


def weighted(values: dict[str, float]) -> float:
    return sum(SAMPLES[c] * v for c, v in values.items()) / sum(SAMPLES[c] for c in values)


def test_a_two_round_job_publishes_weighted_averages_and_replicas(job: str) -> None:
    j = Job(make_settings(job))
    sink = ListSink()
    dataset = load_dataset("fashion_mnist_sample", None, env={})
    evaluator = build_evaluator(j.settings, dataset.test)
    aggregator = Aggregator(j.settings, j.backends, sink=sink, evaluator=evaluator)

    records = j.run(aggregator)

    assert j.store.versions(job) == [1, 2, 3]
    assert sink.status == "finished" and sink.records == records
    assert [(r.version, r.round, r.participants) for r in records] == [(2, 1, 3), (3, 2, 3)]
    # Round r: client k sends k + 1 + 10 r everywhere; the worker hands in 50 + r.
    for version, r in ((2, 0), (3, 1)):
        expected = weighted({c: client_value(i)(r) for i, c in enumerate("abc")})
        assert_all(j.blob(version, CLIENT), expected)
        assert_all(j.blob(version, SERVER), 50.0 + r)
        # SFL trains no auxiliary head: the model has none and no version carries any.
        assert AUX not in j.store.manifest(job, version).entries
    # Both rounds told the worker the whole cohort with its sample counts, then ended.
    assert [dict(s.participants) for s in j.worker.starts] == [{"a": 100, "b": 200, "c": 300}] * 2
    assert [(e.round, e.version) for e in j.worker.ends] == [(0, 1), (1, 2)]
    # Round 1's assignment carried version 2's client weights; then the job finished.
    for fake in j.clients.values():
        got = fake.assignments()
        assert [(a.round, a.version, a.participate) for a in got] == [
            (0, 1, True),
            (1, 2, True),
            (2, 3, False),
        ]
        assert got[-1].config["finished"] is True
        torch.testing.assert_close(dict(got[1].client_weights), j.blob(2, CLIENT))
    # Metrics: samples, sample-weighted train loss, bytes, and an evaluation that matches an
    # independent one of the published weights.
    first = records[0]
    assert first.samples == 300  # trained, not held: the fakes report half their data
    assert first.train_loss == pytest.approx(1.0 + weighted({"a": 1.0, "b": 2.0, "c": 3.0}))
    assert first.bytes_up > 3 * 1000 and first.bytes_down > 3 * 2000
    blobs = {ref: j.blob(2, ref) for ref in (CLIENT, SERVER)}
    test = dataset.test
    capped = type(test)(test.x[:200], test.y[:200])
    model = build_evaluator(j.settings, capped)._model
    reference = evaluate(model, full_model_weights(blobs), capped)
    assert first.global_accuracy == pytest.approx(reference.accuracy)
    assert first.global_loss == pytest.approx(reference.loss)
    personal = [reference.accuracy_on([i]) for i in range(3)]
    assert first.personal_accuracy == pytest.approx(sum(personal) / 3)


def test_a_client_joining_after_round_0_is_in_round_1_only(job: str) -> None:
    j = Job(make_settings(job, clients={"count": 4}), "abcd", members="abc")

    class JoinAfterRound0(ListSink):
        def record(self, record: VersionRecord) -> None:
            super().record(record)
            if record.round == 1:  # before round 2 opens: record() runs on the round clock
                add_member(j.store, job, "d", samples=SAMPLES["d"], partition=3)

    records = j.run(Aggregator(j.settings, j.backends, sink=JoinAfterRound0()))

    assert [set(s.participants) for s in j.worker.starts] == [set("abc"), set("abcd")]
    assert [r.participants for r in records] == [3, 4]
    assert [(a.round, a.participate) for a in j.clients["d"].assignments()] == [
        (1, True),
        (2, False),
    ]
    values = {c: client_value(i)(1) for i, c in enumerate("abcd")}
    assert_all(j.blob(3, CLIENT), weighted(values))


def test_a_round_trains_per_round_members_and_the_others_get_nothing(job: str) -> None:
    clients = {"count": 4, "min_to_start": 4, "per_round": 2}
    j = Job(make_settings(job, job={"seed": 5}, clients=clients), "abcd")

    records = j.run(Aggregator(j.settings, j.backends, sink=ListSink()))

    cohorts = [set(s.participants) for s in j.worker.starts]
    # The seeded draw: with seed 5, {a, c} then {b, d}, so every member sits one round out.
    assert cohorts == [set(sample_cohort("abcd", 2, seed=5, round_index=r)) for r in (0, 1)]
    assert cohorts == [set("ac"), set("bd")]
    assert [r.participants for r in records] == [2, 2]
    for client, fake in j.clients.items():
        trained = [a.round for a in fake.assignments() if a.participate]
        assert trained == [r for r, cohort in enumerate(cohorts) if client in cohort]


def test_a_straggler_does_not_stall_the_round_and_its_late_update_is_refused(job: str) -> None:
    j = Job(make_settings(job, rounds={"deadline_s": 30.0, "quorum": 0.5}))
    round0: list[WeightsAssignment] = []

    def straggle(fake: FakeClient, assignment: WeightsAssignment) -> list[bytes]:
        if assignment.round == 0:
            round0.append(assignment)  # and say nothing
            return []
        late = fake.update(round0[0])
        return [encode(late), encode(fake.update(assignment))]

    j.clients["c"].script = straggle
    clock = ManualClock()
    aggregator = Aggregator(j.settings, j.backends, sink=ListSink(), clock=clock)

    def past_the_deadline() -> None:
        wait_until(lambda: min(j.clients["a"].sent, j.clients["b"].sent) > 0, "a+b updates")
        clock.advance(31.0)

    records = j.run(aggregator, past_the_deadline)

    assert [(r.round, r.participants, r.late_updates) for r in records] == [(1, 2, 0), (2, 3, 1)]
    assert_all(j.blob(2, CLIENT), weighted({"a": 1.0, "b": 2.0}))
    errors = j.clients["c"].errors()
    assert [e.code for e in errors] == ["round_closed"]
    assert aggregator.inbox_stats.late == 1


def test_an_expired_cohort_member_is_not_waited_for(job: str) -> None:
    store_clock = ManualClock()
    store = InMemoryWeightStore(clock=store_clock)
    j = Job(make_settings(job, job={"rounds": 1}), store=store)
    j.clients["c"].script = lambda fake, assignment: []  # never answers, then stops beating
    clock = ManualClock()
    aggregator = Aggregator(j.settings, j.backends, sink=ListSink(), clock=clock)

    def c_expires() -> None:
        wait_until(lambda: min(j.clients["a"].sent, j.clients["b"].sent) > 0, "a+b updates")
        store_clock.advance(61.0)  # every heartbeat lapses; a and b beat again, c does not
        for c in "ab":
            store.heartbeat(job, member_id(c), 60.0)
        clock.advance(2.0)  # far from the 60 s deadline: only the expiry can close the round

    records = j.run(aggregator, c_expires)

    assert [(r.round, r.participants) for r in records] == [(1, 2)]
    assert_all(j.blob(2, CLIENT), weighted({"a": 1.0, "b": 2.0}))


def test_a_round_nobody_answers_is_reopened_without_a_new_version(job: str) -> None:
    settings = make_settings(job, job={"rounds": 1}, clients={"count": 1, "min_to_start": 1})
    j = Job(settings, "a")
    answered: list[int] = []

    def second_time(fake: FakeClient, assignment: WeightsAssignment) -> list[bytes]:
        answered.append(assignment.round)
        return [encode(fake.update(assignment))] if len(answered) > 1 else []

    j.clients["a"].script = second_time
    clock = ManualClock()
    aggregator = Aggregator(j.settings, j.backends, sink=ListSink(), clock=clock)

    def silence() -> None:
        wait_until(lambda: len(answered) == 1, "the first assignment")
        clock.advance(2 * 60.0 + 1)

    records = j.run(aggregator, silence)

    assert aggregator.stats.reopened == 1
    assert answered == [0, 0]
    assert [s.round for s in j.worker.starts] == [0, 0]
    assert [(r.version, r.round, r.participants) for r in records] == [(2, 1, 1)]
    assert j.store.versions(job) == [1, 2]


def test_malformed_duplicate_and_foreign_updates(job: str) -> None:
    j = Job(make_settings(job, job={"rounds": 1}))

    def messy(fake: FakeClient, assignment: WeightsAssignment) -> list[bytes]:
        good = fake.update(assignment)
        weights = dict(good.client_weights)
        name = sorted(weights)[0]
        weights[name] = torch.zeros(3)
        bad_shape = WeightsUpdate(
            good.job, good.client, "m1", good.version, good.round, good.samples, weights, {}
        )
        foreign = WeightsUpdate(
            "otherjob", good.client, "m2", good.version, good.round, good.samples,
            good.client_weights, {},
        )  # fmt: skip
        duplicate = fake.update(assignment, value=99.0)
        return [encode(bad_shape), b"\x00garbage", encode(foreign), encode(good), encode(duplicate)]

    j.clients["a"].script = messy
    aggregator = Aggregator(j.settings, j.backends, sink=ListSink())

    records = j.run(aggregator)

    assert records[0].participants == 3
    assert_all(j.blob(2, CLIENT), weighted({"a": 1.0, "b": 2.0, "c": 3.0}))  # not the 99s
    stats = aggregator.inbox_stats
    assert (stats.dead_lettered, stats.duplicates, stats.accepted) == (3, 1, 3)
    broker = j.backends.open_broker("dead")
    try:
        broker.subscribe(dead_queue_name(job), prefetch=10)
        reasons = []
        for _ in range(3):
            delivery = broker.get(WAIT_S)
            assert delivery is not None
            reasons.append(str(delivery.headers[REASON_HEADER]))
    finally:
        broker.close()
    assert "shape [3]" in reasons[0] and name_in(reasons[0])
    assert reasons[1].startswith("undecodable")
    assert "otherjob" in reasons[2]


def name_in(reason: str) -> bool:
    return reason.startswith("client_weights.blocks.")


def test_two_aggregators_starting_together_publish_one_version_1(job: str) -> None:
    barrier = threading.Barrier(2, timeout=WAIT_S)

    class MeetingStore(InMemoryWeightStore):
        """Both aggregators see "no version" before either publishes."""

        conflicts = 0

        def current_version(self, job: str) -> int:
            version = super().current_version(job)
            if version == 0:
                barrier.wait()
            return version

        def publish_version(
            self,
            job: str,
            expected_current: int,
            blobs: Mapping[BlobRef, Weights],
            *,
            samples: Mapping[BlobRef, int] | None = None,
            meta: Mapping[str, str] | None = None,
        ) -> int:
            try:
                return super().publish_version(
                    job, expected_current, blobs, samples=samples, meta=meta
                )
            except VersionConflictError:
                MeetingStore.conflicts += 1
                raise

    store = MeetingStore()
    settings = make_settings(job)
    strategy = build_strategy(settings.algorithm.name, settings.algorithm.params())
    results: list[int] = []
    threads = [
        threading.Thread(
            target=lambda: results.append(ensure_initial_version(store, settings, strategy, LOG))
        )
        for _ in range(2)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT_S)

    assert results == [1, 1]
    assert store.versions(job) == [1]
    assert MeetingStore.conflicts == 1


def test_an_aggregator_that_loses_the_version_race_moves_on(job: str) -> None:
    class RacingStore(InMemoryWeightStore):
        """Another aggregator commits version 2 just before ours does."""

        raced = False

        def publish_version(
            self,
            job: str,
            expected_current: int,
            blobs: Mapping[BlobRef, Weights],
            *,
            samples: Mapping[BlobRef, int] | None = None,
            meta: Mapping[str, str] | None = None,
        ) -> int:
            if expected_current == 1 and not self.raced:
                self.raced = True
                theirs = dict(self.read_blob(job, 1, SERVER))
                mine = {ref: dict(w) for ref, w in blobs.items()}
                mine[CLIENT] = filled(mine[CLIENT], 9.0)
                mine[SERVER] = theirs
                super().publish_version(job, 1, mine)
            return super().publish_version(job, expected_current, blobs, samples=samples, meta=meta)

    j = Job(make_settings(job), store=RacingStore())
    aggregator = Aggregator(j.settings, j.backends, sink=ListSink())

    records = j.run(aggregator)

    assert aggregator.stats.conflicts == 1
    assert j.store.versions(job) == [1, 2, 3]
    assert_all(j.blob(2, CLIENT), 9.0)  # the winner's, untouched
    assert [(r.version, r.round) for r in records] == [(3, 2)]
    round1 = j.clients["a"].assignments()[1]
    assert (round1.round, round1.version) == (1, 2)
    assert_all(dict(round1.client_weights), 9.0)
    assert_all(j.blob(3, CLIENT), weighted({c: client_value(i)(1) for i, c in enumerate("abc")}))


def test_garbage_never_reaches_the_round(job: str) -> None:
    """A message of the wrong type on the updates queue is dead-lettered, the job goes on."""
    j = Job(make_settings(job, job={"rounds": 1}))

    def wrong_type(fake: FakeClient, assignment: WeightsAssignment) -> list[bytes]:
        error = Error(job, fake.client, "e1", 1, "oops", "not an update")
        return [encode(error), encode(fake.update(assignment))]

    j.clients["b"].script = wrong_type
    aggregator = Aggregator(j.settings, j.backends, sink=ListSink())
    records = j.run(aggregator)
    assert records[0].participants == 3
    assert aggregator.inbox_stats.dead_lettered == 1
