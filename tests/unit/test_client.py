"""The edge client against scripted peers on the in-memory hub (fast, deterministic)."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import pytest

from broker.codec import encode
from broker.errors import BackPressureError
from broker.memory_broker import InMemoryBroker
from broker.messages import Welcome, new_message_id
from broker.topology import dead_queue_name, reply_routing_key
from broker.transport import REASON_HEADER, Broker
from services.client.client import Client
from services.client.data import JobData
from services.client.errors import JoinTimeoutError
from services.client.stats import ClientStats
from services.common.backends import Backends, Embedded
from services.config.root import Settings
from services.config.settings import BrokerSettings, StoreSettings
from services.data.loaders import Dataset, load_dataset
from services.data.partition import client_classes
from tests.unit.test_client_peers import (
    PeerLog,
    PeerScript,
    ScriptedPeers,
    make_settings,
    max_diff,
    partition_indices,
    reference_fedavg,
    reference_split,
    round_batches,
)

TOL = 1e-5
CLIENT = "c1"


@pytest.fixture(scope="module")
def dataset() -> Dataset:
    return load_dataset("fashion_mnist_sample", env={})


@dataclass
class Run:
    stats: ClientStats
    log: PeerLog


def memory_backends() -> Backends:
    return Backends(BrokerSettings(), StoreSettings(), Embedded())


def run_client(
    settings: Settings,
    dataset: Dataset,
    script: PeerScript,
    *,
    backends: Backends | None = None,
    partition: int | None = 3,
    **client_options: object,
) -> Run:
    backends = backends or memory_backends()
    halt = threading.Event()
    peers = ScriptedPeers(settings, backends, script, halt)
    peers.start()
    assert peers.ready.wait(10)
    client = Client(
        settings,
        backends,
        client_id=CLIENT,
        partition=partition,
        dataset=JobData(settings, dataset),
        **client_options,  # type: ignore[arg-type]
    )
    try:
        stats = client.run(threading.Event())
    finally:
        halt.set()
    return Run(stats, peers.finish())


def test_split_rounds_match_a_reference_loop(job: str, dataset: Dataset) -> None:
    settings = make_settings(job)
    run = run_client(settings, dataset, PeerScript(rounds=2))

    expected = reference_split(settings, dataset, 3, rounds=2)
    assert len(run.log.updates) == 2
    for update, reference in zip(run.log.updates, expected, strict=True):
        assert max_diff(dict(update.client_weights), reference) <= TOL
    batches = round_batches(settings, dataset, 3, 0)
    steps = len(batches)
    assert steps == settings.algorithm.max_steps_per_round  # crosses an epoch boundary
    assert [u.round for u in run.log.updates] == [0, 1]
    assert [u.version for u in run.log.updates] == [1, 2]
    first = run.log.updates[0]
    assert first.samples == len(partition_indices(settings, dataset, 3))
    assert first.metrics["train_samples"] == sum(len(y) for _, y in batches)
    assert 0.0 <= first.metrics["train_accuracy"] <= 1.0
    assert first.metrics["train_loss"] > 0.0
    assert first.metrics["bytes_up"] > 0 and first.metrics["bytes_down"] > 0
    assert run.stats.rounds == 2 and run.stats.finished
    assert run.stats.batches_sent == run.stats.replies_received == 2 * steps
    assert run.stats.duplicates_dropped == 0 and run.stats.republished == 0
    # The Join tells the coordinator its partition, size and classes.
    join = run.log.joins[0]
    classes = client_classes(dataset.train.y.numpy(), partition_indices(settings, dataset, 3))
    assert {k: v for k, v in join.info.items() if k != "session"} == {
        "index": "3",
        "classes": ",".join(str(int(c)) for c in classes),
    }
    assert join.info["session"]  # names this process: a restarted client is another one
    assert join.samples == first.samples
    assert run.log.heartbeats >= 1
    assert [leave.reason for leave in run.log.leaves] == ["finished"]


def test_duplicate_reply_for_an_applied_seq_is_dropped(job: str, dataset: Dataset) -> None:
    settings = make_settings(job)
    run = run_client(settings, dataset, PeerScript(duplicate_replies=True))

    # Each duplicate carries a bogus gradient: applying even one would move the weights.
    reference = reference_split(settings, dataset, 3, rounds=1)[0]
    assert max_diff(dict(run.log.updates[0].client_weights), reference) <= TOL
    steps = settings.algorithm.max_steps_per_round
    assert run.stats.duplicates_dropped == steps
    assert run.stats.replies_received == steps


class RefusalSpy:
    """A broker handle that reports the first publish refused for back-pressure."""

    def __init__(self, inner: Broker, refused: threading.Event) -> None:
        self._inner = inner
        self._refused = refused

    def publish(self, *args: Any, **kwargs: Any) -> None:
        try:
            self._inner.publish(*args, **kwargs)
        except BackPressureError:
            self._refused.set()
            raise

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


@dataclass(frozen=True)
class SpyBackends(Backends):
    refused: threading.Event = field(default_factory=threading.Event)

    def open_broker(self, name: str = "", **kwargs: Any) -> Broker:
        inner = super().open_broker(name, **kwargs)
        return RefusalSpy(inner, self.refused)


def test_back_pressure_is_retried_until_the_worker_catches_up(job: str, dataset: Dataset) -> None:
    settings = make_settings(job)
    backends = SpyBackends(BrokerSettings(), StoreSettings(), Embedded())
    # The shard queue holds one message and a filler occupies it; the worker starts only once
    # the client has been refused.
    script = PeerScript(shard_max_length=1, filler=True, worker_gate=backends.refused)
    run = run_client(settings, dataset, script, backends=backends)

    assert run.stats.backpressure_retries > 0
    assert run.stats.rounds == 1
    reference = reference_split(settings, dataset, 3, rounds=1)[0]
    assert max_diff(dict(run.log.updates[0].client_weights), reference) <= TOL


def test_reply_timeout_republishes_the_same_seq(job: str, dataset: Dataset) -> None:
    settings = make_settings(job, clients={"reply_timeout_s": 0.2})
    run = run_client(settings, dataset, PeerScript(ignore_first_batch=True))

    first, again = run.log.batches[0], run.log.batches[1]
    assert again == first  # same seq, same message id
    # A slow machine may time out more replies; each republish repeats its batch exactly.
    seqs = sorted({seq for seq, _ in run.log.batches})
    assert seqs == list(range(seqs[0], seqs[0] + settings.algorithm.max_steps_per_round))
    assert run.stats.republished == len(run.log.batches) - len(seqs) >= 1
    # Heartbeats go on while the client waits (>= 0.2 s here, one every 0.05 s).
    assert run.log.heartbeats >= 3
    reference = reference_split(settings, dataset, 3, rounds=1)[0]
    assert max_diff(dict(run.log.updates[0].client_weights), reference) <= TOL


def test_stale_answer_to_a_copy_keeps_the_client_waiting(job: str, dataset: Dataset) -> None:
    # MiniBatch-SFL's barrier can hold a batch past the reply timeout: the worker answers the
    # client's copy "stale" at once and the real gradient later.
    settings = make_settings(job, clients={"reply_timeout_s": 0.2})
    run = run_client(settings, dataset, PeerScript(stale_before_ok=True))

    assert run.stats.stale_replies >= 1 and run.stats.rounds_aborted == 0
    reference = reference_split(settings, dataset, 3, rounds=1)[0]
    assert max_diff(dict(run.log.updates[0].client_weights), reference) <= TOL


def test_client_gives_up_a_seq_nobody_answers(job: str, dataset: Dataset) -> None:
    settings = make_settings(job, clients={"reply_timeout_s": 0.05})
    run = run_client(settings, dataset, PeerScript(silent_until_finish=3), max_republish=2)

    assert [seq for seq, _ in run.log.batches] == [run.log.batches[0][0]] * 3
    assert run.stats.republished == 2
    assert run.stats.rounds_aborted == 1 and run.stats.rounds == 0
    assert run.log.updates == [] and run.stats.finished


def test_finished_assignment_makes_the_client_leave(job: str, dataset: Dataset) -> None:
    settings = make_settings(job)
    # Junk ahead of the Welcome on the client's reply queue: undecodable, and another job's.
    foreign = Welcome("other", CLIENT, new_message_id(), 1, 0, "block1", 0, {}, {}, {})
    key = reply_routing_key(job, CLIENT)
    backends = memory_backends()
    script = PeerScript(
        finish_at_once=True, before_welcome=[(b"junk", key), (encode(foreign), key)]
    )
    run = run_client(settings, dataset, script, backends=backends)

    assert run.stats.finished and run.stats.rounds == 0
    assert run.stats.dead_lettered == 2
    assert [leave.reason for leave in run.log.leaves] == ["finished"]
    assert backends.embedded is not None
    assert InMemoryBroker(backends.embedded.hub).queue_depth(dead_queue_name(job)) == 2


def test_fedavg_trains_the_whole_model_without_smashed_data(job: str, dataset: Dataset) -> None:
    settings = make_settings(job, algorithm={"name": "fedavg"})
    run = run_client(settings, dataset, PeerScript())

    reference = reference_fedavg(settings, dataset, 3)
    update = run.log.updates[0]
    assert max_diff(dict(update.client_weights), reference) <= TOL
    assert run.stats.batches_sent == 0 and run.log.batches == []
    assert 0.0 <= update.metrics["personal_accuracy"] <= 1.0
    assert 0.0 <= update.metrics["train_accuracy"] <= 1.0
    assert update.metrics["train_loss"] > 0.0


def test_partition_assigned_by_the_welcome(job: str, dataset: Dataset) -> None:
    settings = make_settings(job)
    run = run_client(settings, dataset, PeerScript(welcome_partition=5), partition=None)

    # The first Join could not describe the data; a second one does, once the index is known.
    first, second = run.log.joins[:2]
    assert first.info.keys() == {"session"} and first.samples == 0
    assert second.info["index"] == "5"
    assert second.info["session"] == first.info["session"]  # one process, one session
    reference = reference_split(settings, dataset, 5, rounds=1)[0]
    assert max_diff(dict(run.log.updates[0].client_weights), reference) <= TOL


def test_assignment_that_does_not_fit_the_model_is_dead_lettered(
    job: str, dataset: Dataset
) -> None:
    settings = make_settings(job)
    backends = memory_backends()
    run = run_client(settings, dataset, PeerScript(bad_assignment=True), backends=backends)

    assert run.stats.dead_lettered == 1
    assert backends.embedded is not None
    assert InMemoryBroker(backends.embedded.hub).queue_depth(dead_queue_name(job)) == 1
    reference = reference_split(settings, dataset, 3, rounds=1)[0]
    assert max_diff(dict(run.log.updates[0].client_weights), reference) <= TOL


def test_rejected_batch_drops_the_round(job: str, dataset: Dataset) -> None:
    settings = make_settings(job)
    run = run_client(settings, dataset, PeerScript(reject_batches=True))

    assert run.stats.rounds_aborted == 1 and run.stats.rounds == 0
    assert run.log.updates == []
    assert run.stats.finished


def test_join_is_sent_again_when_unanswered(job: str, dataset: Dataset) -> None:
    settings = make_settings(job)
    run = run_client(settings, dataset, PeerScript(ignore_joins=1), join_retry_s=0.1)

    assert len(run.log.joins) >= 2
    assert run.stats.rounds == 1


def test_expired_membership_joins_again_instead_of_stalling(job: str, dataset: Dataset) -> None:
    settings = make_settings(job)
    run = run_client(settings, dataset, PeerScript(forget_member=True))

    assert len(run.log.joins) >= 2
    assert run.stats.errors_received >= 1
    assert run.stats.rounds == 1


def test_join_gives_up_with_a_clear_error(job: str, dataset: Dataset) -> None:
    settings = make_settings(job)
    with pytest.raises(JoinTimeoutError, match="no Welcome"):
        run_client(
            settings,
            dataset,
            PeerScript(ignore_joins=1000),
            join_retry_s=0.05,
            join_give_up_s=0.3,
        )


def test_stop_while_idle_sends_leave(job: str, dataset: Dataset) -> None:
    settings = make_settings(job)
    backends = memory_backends()
    halt, stop = threading.Event(), threading.Event()
    peers = ScriptedPeers(settings, backends, PeerScript(assign=False), halt)
    peers.start()
    assert peers.ready.wait(10)
    client = Client(settings, backends, client_id=CLIENT, partition=3, dataset=dataset)
    stopper = threading.Thread(target=lambda: peers.heartbeat_seen.wait(30) and stop.set())
    stopper.start()
    try:
        stats = client.run(stop)
    finally:
        halt.set()
    log = peers.finish()
    stopper.join()

    assert stats.rounds == 0 and not stats.finished
    assert [leave.reason for leave in log.leaves] == ["stopped"]


def test_gone_answer_to_a_copy_drops_the_round_at_once(job: str, dataset: Dataset) -> None:
    # The batch was applied, its reply lost, and the worker answering the copy no longer has
    # the gradient: no wait brings it, so the round ends at the first answer, said at once.
    settings = make_settings(job, clients={"reply_timeout_s": 0.2})
    run = run_client(settings, dataset, PeerScript(gone_after_first=True), max_republish=5)

    assert run.stats.republished == 1 and run.stats.gone_replies == 1
    assert run.stats.rounds_aborted == 1 and run.stats.rounds == 0
    assert [d.reason for d in run.log.drops] == ["aborted"]
    assert "gradient is gone" in run.log.drops[0].detail
    assert run.log.updates == [] and run.stats.finished


def test_replies_for_seqs_never_sent_are_dead_lettered(job: str, dataset: Dataset) -> None:
    settings = make_settings(job)
    backends = memory_backends()
    script = PeerScript(rounds=2, unsent_replies=True)
    run = run_client(settings, dataset, script, backends=backends)

    steps = settings.algorithm.max_steps_per_round
    # One beside every gradient, one between the rounds: none applied, none taken as late.
    unsent = 2 * steps + 1
    assert run.stats.dead_lettered == unsent and run.stats.duplicates_dropped == 0
    assert run.stats.replies_received == 2 * steps
    expected = reference_split(settings, dataset, 3, rounds=2)
    for update, reference in zip(run.log.updates, expected, strict=True):
        assert max_diff(dict(update.client_weights), reference) <= TOL
    assert backends.embedded is not None
    dead = InMemoryBroker(backends.embedded.hub)
    dead.subscribe(dead_queue_name(job), prefetch=100)
    reasons = []
    while (delivery := dead.get(0.2)) is not None:
        dead.ack(delivery)
        reasons.append(str(delivery.headers.get(REASON_HEADER)))
    assert len(reasons) == unsent
    assert all("never sent by this client" in r for r in reasons), reasons
