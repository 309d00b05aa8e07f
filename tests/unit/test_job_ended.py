"""A job that ended stays ended: the store's `JobStatus` (docs/reliability.md "Liveness").

After a job failed (or finished), a client that joins late is dismissed with the job's status
and exits, and a restarted aggregator sees the record and ends at once, publishing nothing.
A new run of the same job name (its keys deleted, as `splitmq up --fresh` does) starts afresh.
"""

from __future__ import annotations

import logging
import threading

import pytest

from broker.codec import decode
from broker.memory_broker import InMemoryBroker
from broker.memory_store import InMemoryWeightStore
from broker.messages import Event
from broker.store import NO_VERSION, JobStatus
from broker.topology import events_queue, reply_queue_name
from services.aggregator.aggregator import Aggregator, ended_job, ensure_initial_version
from services.algorithms.registry import build_strategy
from services.client.client import Client
from services.client.data import JobData
from services.client.stats import ClientStats
from services.common.membership import client_members
from services.common.supervise import JobFailedError
from services.config.root import Settings
from services.coordinator.coordinator import Coordinator
from services.data.loaders import Dataset, load_dataset
from services.report.records import ListSink
from tests.unit.test_aggregator import Job
from tests.unit.test_aggregator_empty_rounds import DEADLINE_S, always_nan, run_until_failed
from tests.unit.test_aggregator_peers import WAIT_S, ManualClock, make_settings, running

LOG = logging.getLogger("test.job_ended")


@pytest.fixture(scope="module")
def dataset() -> Dataset:
    return load_dataset("fashion_mnist_sample", env={})


def failing_settings(job: str) -> Settings:
    return make_settings(job, rounds={"deadline_s": DEADLINE_S, "max_empty_attempts": 2})


def failed_job(job: str) -> tuple[Job, str]:
    """A job whose clients send only NaN, failed after two empty attempts; the reason."""
    j = Job(failing_settings(job))
    for fake in j.clients.values():
        fake.script = always_nan
    aggregator = Aggregator(j.settings, j.backends, sink=ListSink(), clock=ManualClock())
    failure, _ = run_until_failed(j, aggregator, attempts=2)
    return j, str(failure)


def join_late(j: Job, dataset: Dataset, client: str) -> ClientStats:
    """A real client joining through a real coordinator; its stats once it exited."""
    coordinator = Coordinator(j.settings, j.backends, poll_s=0.02)
    late = Client(
        j.settings,
        j.backends,
        client_id=client,
        dataset=JobData(j.settings, dataset),
        join_give_up_s=WAIT_S,
    )
    result: list[ClientStats] = []
    exited = threading.Event()

    def client(stop: threading.Event) -> None:
        result.append(late.run(stop))
        exited.set()

    with running([coordinator.run, client]):
        assert exited.wait(WAIT_S), "the late client did not exit"
    return result[0]


class Restart:
    """An aggregator started again on the same store, watched from the events fanout."""

    def __init__(self, j: Job) -> None:
        self.events = InMemoryBroker(j.embedded.hub)
        spec = events_queue(j.name, "restart")
        self.events.declare([spec])
        self.events.subscribe(spec.name, prefetch=100)
        self.sink = ListSink()
        self.aggregator = Aggregator(j.settings, j.backends, sink=self.sink, clock=ManualClock())

    def run(self) -> tuple[list[object], BaseException | None]:
        """What `run` returned (or raised); bounded: a resumed round would wait for ever."""
        out: list[object] = []
        errors: list[BaseException] = []
        stop = threading.Event()

        def target() -> None:
            try:
                out.append(self.aggregator.run(stop))
            except BaseException as exc:
                errors.append(exc)

        thread = threading.Thread(target=target, daemon=True)
        thread.start()
        thread.join(WAIT_S)
        stop.set()
        thread.join(WAIT_S)
        assert out or errors, "the restarted aggregator did not end"
        return out, errors[0] if errors else None

    def published(self) -> list[Event]:
        seen = []
        while (delivery := self.events.get(0.0)) is not None:
            message = decode(delivery.body)
            assert isinstance(message, Event)
            seen.append(message)
        return seen


def test_after_a_failure_late_clients_are_told_and_a_restart_changes_nothing(
    job: str, dataset: Dataset
) -> None:
    j, reason = failed_job(job)
    assert j.store.job_status(job) == JobStatus("failed", reason)

    stats = join_late(j, dataset, "late")
    assert stats.finished and stats.rounds == 0
    assert stats.job_status == f"failed: {reason}"
    assert "late" not in client_members(j.store, job)

    hub = InMemoryBroker(j.embedded.hub)
    depths = {c: hub.queue_depth(reply_queue_name(job, c)) for c in j.clients}
    restart = Restart(j)
    returned, error = restart.run()

    assert returned == [] and isinstance(error, JobFailedError)
    assert str(error) == reason, "it fails the same way, not with a new reason"
    assert restart.sink.status == f"failed: {reason}" and restart.sink.records == []
    assert restart.aggregator.stats.reopened == 0
    assert j.store.versions(job) == [1]
    assert restart.published() == [], "no round opened, no second job_finished"
    assert {c: hub.queue_depth(reply_queue_name(job, c)) for c in j.clients} == depths
    assert j.store.job_status(job) == JobStatus("failed", reason)


def test_after_a_finish_a_restart_exits_cleanly_without_a_second_dismissal(job: str) -> None:
    j = Job(make_settings(job, job={"rounds": 1}))
    first = ListSink()
    records = j.run(Aggregator(j.settings, j.backends, sink=first, clock=ManualClock()))
    assert first.status == "finished" and [r.version for r in records] == [2]
    assert j.store.job_status(job) == JobStatus("finished")

    restart = Restart(j)
    returned, error = restart.run()

    assert error is None and returned == [[]]
    assert restart.sink.status == "finished"
    assert restart.published() == []
    assert j.store.versions(job) == [1, 2]


def test_a_new_run_of_the_job_name_starts_afresh(job: str) -> None:
    j, _ = failed_job(job)
    # What `splitmq up` (--fresh, its default) does before it starts the roles.
    j.store.delete_job(job)
    again = Job(j.settings, store=j.store)
    sink = ListSink()
    records = again.run(Aggregator(again.settings, again.backends, sink=sink, clock=ManualClock()))

    assert sink.status == "finished"
    assert [r.version for r in records] == [2, 3]
    assert j.store.job_status(job) == JobStatus("finished")


def test_seeding_version_1_clears_a_status_the_name_kept(job: str) -> None:
    # E.g. a store whose versions were deleted by hand but not the status: a job without any
    # version is new, and an old run's end must not end it.
    store = InMemoryWeightStore()
    settings = failing_settings(job)
    store.set_job_status(job, JobStatus("failed", "an earlier run"))
    assert store.current_version(job) == NO_VERSION
    assert ended_job(store, job) is None, "no version: not this run's end"

    strategy = build_strategy(settings.algorithm.name, settings.algorithm.params())
    assert ensure_initial_version(store, settings, strategy, LOG) == 1
    assert store.job_status(job) is None
    assert ended_job(store, job) is None

    # Once a version exists, a status does end the job; seeding again changes nothing.
    store.set_job_status(job, JobStatus("finished"))
    assert ensure_initial_version(store, settings, strategy, LOG) == 1
    assert ended_job(store, job) == JobStatus("finished")
