"""A deterministic job's shard: one canonical order whatever the arrival order, and the schedule
it records (issue 36). On the in-memory broker and store, with a scripted client."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any

import pytest
import torch

from broker.memory_broker import InMemoryBroker
from broker.store import WeightStore
from broker.topology import reply_queue_name
from services.common.backends import Backends, Embedded
from services.common.membership import member_id
from services.common.schedule import (
    Applied,
    Checkpointed,
    Entry,
    Restored,
    decode,
    shard_stream,
    state_digest,
)
from tests.unit.test_aggregator_peers import add_member
from tests.unit.test_worker_support import (
    ScriptedClient,
    make_settings,
    one_torch_thread,
    random_batch,
    seed_version,
)
from workers.stats import WorkerStats
from workers.worker import Worker

__all__ = ["one_torch_thread"]  # the autouse fixture, imported so that it applies here

COHORT = {"c": 30, "a": 10, "b": 20}  # the RoundStart's order, not alphabetical
STEPS = 2
CANONICAL = [(client, step) for step in range(STEPS) for client in COHORT]
# Two arrival orders a shard queue may see (each client's steps in order: it waits for replies).
ARRIVALS = (
    [("a", 0), ("a", 1), ("b", 0), ("c", 0), ("b", 1), ("c", 1)],
    [("b", 0), ("c", 0), ("b", 1), ("a", 0), ("c", 1), ("a", 1)],
)


def join_all(store: WeightStore, job: str) -> None:
    """The cohort's members, as the coordinator records them: a shard stops waiting for a
    client that is no member any more (it left)."""
    for i, name in enumerate(COHORT):
        add_member(store, job, name, samples=10, partition=i)


def run_job(
    job: str,
    arrivals: Sequence[tuple[str, int]],
    *,
    deterministic: bool = True,
    script: Sequence[Entry] | None = None,
    left: Sequence[str] = (),
    **sections: Any,
) -> tuple[Embedded, ScriptedClient, WorkerStats]:
    """One round of SFL-V2 on `arrivals` (the same data for the same (client, step) in every
    job), served by a burst worker."""
    settings = make_settings(job, clients={"count": len(COHORT)}, **sections)
    flag = settings.job.model_copy(update={"deterministic": deterministic})
    settings = settings.model_copy(update={"job": flag})
    embedded = Embedded()
    model = seed_version(embedded.store, settings)
    client = ScriptedClient(InMemoryBroker(embedded.hub), job)
    client.declare(list(COHORT))
    join_all(embedded.store, job)
    for name in left:  # members no more, as after their Leave
        embedded.store.remove_member(job, member_id(name))
    gen = torch.Generator().manual_seed(7)
    data = {key: random_batch(model, gen) for key in CANONICAL}
    client.round_start(0, COHORT)
    for name, step in arrivals:
        client.batch(name, step, *data[name, step], step=step, steps=STEPS)
    client.round_end(0)
    stats = run_burst(settings, embedded, "w1", script=script)
    return embedded, client, stats


def run_burst(
    settings: Any, embedded: Embedded, worker: str, *, script: Sequence[Entry] | None = None
) -> WorkerStats:
    """`script`: shard 0's recorded stream, served in its order (a replay's worker)."""
    backends = Backends(settings.broker, settings.store, embedded)
    scripts = None if script is None else {0: script}
    return Worker(settings, backends, worker_id=worker, script=scripts).run(
        threading.Event(), burst=True
    )


def entries(embedded: Embedded, job: str) -> list[Entry]:
    return [decode(line) for line in embedded.store.read_schedule(job).get(shard_stream(0), [])]


def applied(embedded: Embedded, job: str) -> list[Applied]:
    return [e for e in entries(embedded, job) if isinstance(e, Applied)]


def server_weights(embedded: Embedded, job: str) -> dict[str, torch.Tensor]:
    checkpoint = embedded.store.load_checkpoint(job, 0)
    assert checkpoint is not None
    return dict(checkpoint.weights)


def test_any_arrival_order_gives_the_same_weights_and_record(job: str) -> None:
    runs = [run_job(f"{job}-{i}", order) for i, order in enumerate(ARRIVALS)]
    (first, *_), (second, *_) = runs
    one, two = server_weights(first, f"{job}-0"), server_weights(second, f"{job}-1")
    assert one.keys() == two.keys()
    for name in one:  # bit for bit, not close
        assert torch.equal(one[name], two[name]), name
    records = [applied(first, f"{job}-0"), applied(second, f"{job}-1")]
    assert records[0] == records[1]
    assert [(e.client, e.step) for e in records[0]] == CANONICAL
    assert [e.position for e in records[0]] == list(range(1, len(CANONICAL) + 1))
    assert [e.step_no for e in records[0]] == list(range(1, len(CANONICAL) + 1))
    assert {(e.shard, e.round, e.version, e.worker) for e in records[0]} == {(0, 0, 1, "w1")}


def test_free_running_serves_in_arrival_order(job: str) -> None:
    """What the sequencer changes: without it the record is the arrival order."""
    embedded, _, _ = run_job(job, ARRIVALS[1], deterministic=False)
    assert [(e.client, e.step) for e in applied(embedded, job)] == ARRIVALS[1]


@pytest.mark.parametrize("deterministic", [False, True])
def test_a_recorded_order_replayed_from_another_arrival_order_gives_the_same_weights(
    job: str, deterministic: bool
) -> None:
    """A free-running run's order (arrival order) is not canonical; a replay's worker, handed
    the record, serves it again whatever order the batches come in this time."""
    run, _, _ = run_job(f"{job}-run", ARRIVALS[1], deterministic=False)
    record = entries(run, f"{job}-run")
    assert [(e.client, e.step) for e in applied(run, f"{job}-run")] == ARRIVALS[1] != CANONICAL
    again, _, _ = run_job(f"{job}-run", ARRIVALS[0], deterministic=deterministic, script=record)
    assert applied(again, f"{job}-run") == applied(run, f"{job}-run")
    one, two = server_weights(run, f"{job}-run"), server_weights(again, f"{job}-run")
    for name in one:  # bit for bit
        assert torch.equal(one[name], two[name]), name


def test_a_silent_client_is_skipped_after_the_timeout(job: str) -> None:
    # "c" is first in the cohort and never sends: the others go on once the timeout is out.
    arrivals = [key for key in ARRIVALS[0] if key[0] != "c"]
    embedded, client, stats = run_job(job, arrivals, workers={"step_barrier_timeout_s": 0.3})
    assert [(e.client, e.step) for e in applied(embedded, job)] == [
        ("a", 0),
        ("b", 0),
        ("a", 1),
        ("b", 1),
    ]
    assert stats.batches_applied == 4
    assert [r.seq for r in client.replies("a")] == [0, 1]


def test_a_client_that_left_is_skipped_without_waiting_out_the_timeout(job: str) -> None:
    # "c" is first in the cohort and left the job: no timeout (30 s here) is waited out.
    arrivals = [key for key in ARRIVALS[0] if key[0] != "c"]
    started = time.monotonic()
    embedded, _, stats = run_job(
        job, arrivals, left=("c",), workers={"step_barrier_timeout_s": 30.0}
    )
    assert time.monotonic() - started < 15.0
    assert [(e.client, e.step) for e in applied(embedded, job)] == [
        ("a", 0),
        ("b", 0),
        ("a", 1),
        ("b", 1),
    ]
    assert stats.batches_applied == 4


@pytest.mark.parametrize("deterministic", [False, True])
def test_every_application_is_recorded_before_its_reply_or_with_its_checkpoint(
    job: str, monkeypatch: pytest.MonkeyPatch, deterministic: bool
) -> None:
    """Free-running: each step's entries before its replies. Deterministic: with the next
    checkpoint (a successor re-applies lost batches in the same order, giving the same
    replies), so the store is written once a checkpoint, not once a step."""
    settings = make_settings(
        job, job={"deterministic": deterministic}, clients={"count": len(COHORT)}
    )
    embedded = Embedded()
    model = seed_version(embedded.store, settings)
    client = ScriptedClient(InMemoryBroker(embedded.hub), job)
    client.declare(list(COHORT))
    join_all(embedded.store, job)
    gen = torch.Generator().manual_seed(7)
    store, hub_broker = embedded.store, client.broker
    appended = store.append_schedule
    replies_then: list[tuple[str, dict[str, int]]] = []
    calls: list[list[str]] = []

    def spy(job_: str, stream: str, lines: Sequence[str]) -> None:
        waiting = {c: hub_broker.queue_depth(reply_queue_name(job, c)) for c in COHORT}
        replies_then.extend((line, waiting) for line in lines)
        calls.append([type(decode(line)).__name__ for line in lines])
        appended(job_, stream, lines)

    monkeypatch.setattr(store, "append_schedule", spy)
    client.round_start(0, COHORT)
    for name, step in ARRIVALS[0]:
        client.batch(name, step, *random_batch(model, gen), step=step, steps=STEPS)
    client.round_end(0)
    run_burst(settings, embedded, "w1")

    checked = 0
    for line, waiting in replies_then:
        entry = decode(line)
        if isinstance(entry, Applied):
            if deterministic:
                # Written with a checkpoint, after the step's reply.
                assert waiting[entry.client] > entry.step, entry
            else:
                # Replies to this client's earlier steps only: not yet the one to this batch.
                assert waiting[entry.client] == entry.step, entry
            checked += 1
    assert checked == len(CANONICAL)
    if deterministic:  # every store call ends with the checkpoint that covers its batches
        assert all(names[-1] == "Checkpointed" for names in calls if "Applied" in names), calls
    else:
        assert sum("Applied" in names for names in calls) == len(CANONICAL)


def test_checkpoints_are_recorded_with_their_digest(job: str) -> None:
    embedded, _, stats = run_job(job, ARRIVALS[0])
    checkpointed = [e for e in entries(embedded, job) if isinstance(e, Checkpointed)]
    assert len(checkpointed) == stats.checkpoints >= 2  # every 3 steps, and at RoundEnd
    last = checkpointed[-1]
    weights = server_weights(embedded, job)
    assert last.position == len(CANONICAL) and last.worker == "w1" and last.version == 1
    assert last.digest == state_digest(weights)
    # Every digest is of the weights saved then: they moved between the two.
    assert len({e.digest for e in checkpointed}) == len(checkpointed)


def test_a_take_over_is_recorded_as_restored(job: str) -> None:
    embedded, _, _ = run_job(job, ARRIVALS[0])
    settings = make_settings(job, clients={"count": len(COHORT)})
    run_burst(settings, embedded, "w2")  # a successor: nothing left to apply, the shard to hold
    restored = [e for e in entries(embedded, job) if isinstance(e, Restored)]
    assert restored == [Restored(shard=0, position=len(CANONICAL), version=1, worker="w2")]
