"""A real worker in async mode over the in-memory hub and store: smashed data beyond the
staleness bound is answered "too_stale" and never trained on, newer versions do not reload
the replica (it keeps training and rebases at its checkpoint), and round markers are refused.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import torch
from torch.testing import assert_close

from broker.memory_broker import InMemoryBroker
from broker.store import SERVER_PART, BlobRef
from broker.topology import dead_queue_name
from broker.transport import REASON_HEADER
from services.aggregator.core import read_version
from services.algorithms.sfl import weighted_step
from services.algorithms.staleness import TOO_STALE
from services.common.backends import Backends, Embedded
from tests.unit.test_aggregator_peers import add_member
from tests.unit.test_worker_support import (
    ScriptedClient,
    make_settings,
    random_batch,
    reference_server,
    seed_version,
)
from workers.worker import Worker

SERVER = BlobRef(SERVER_PART)


def setup(job: str) -> tuple[Any, Embedded, Any, ScriptedClient]:
    settings = make_settings(
        job,
        rounds={"mode": "async"},
        asynchronous={"worker_max_staleness": 1, "max_staleness": 1},
        workers={"checkpoint_every_steps": 50, "checkpoint_every_s": 60.0},
    )
    embedded = Embedded()
    model = seed_version(embedded.store, settings)
    add_member(embedded.store, job, "c0", samples=100)
    client = ScriptedClient(InMemoryBroker(embedded.hub), job, settings.shards)
    client.declare(["c0"])
    return settings, embedded, model, client


def publish_copy(embedded: Embedded, job: str) -> int:
    """A new version with the same weights (as if the aggregator folded client updates only)."""
    version = embedded.store.current_version(job)
    return embedded.store.publish_version(job, version, read_version(embedded.store, job, version))


def test_too_stale_smashed_data_is_refused_and_newer_versions_do_not_reload(job: str) -> None:
    settings, embedded, model, client = setup(job)
    worker = Worker(settings, Backends(settings.broker, settings.store, embedded), worker_id="w")
    gen = torch.Generator().manual_seed(3)
    batches = [random_batch(model, gen) for _ in range(5)]
    stop = threading.Event()
    result: list[Any] = []
    thread = threading.Thread(target=lambda: result.append(worker.run(stop)), daemon=True)
    thread.start()
    try:
        client.batch("c0", 0, *batches[0], version=1)
        assert [r.status for r in client.drain_replies("c0", 1)] == ["ok"]
        publish_copy(embedded, job)
        publish_copy(embedded, job)
        # Version 3 arrives with smashed data; then data of version 1 (2 behind, bound 1),
        # version 2 (1 behind), and a version never published.
        for seq, version in ((1, 3), (2, 1), (3, 2), (4, 9)):
            client.batch("c0", seq, *batches[seq], version=version, round_=seq)
        replies = client.drain_replies("c0", 3)
        give_up = time.monotonic() + 20
        while client.broker.queue_depth(dead_queue_name(job)) < 1:  # the version-9 batch
            assert time.monotonic() < give_up, "the batch of an unknown version was kept"
            time.sleep(0.02)
    finally:
        stop.set()
        thread.join(20)
    (stats,) = result
    assert [(r.seq, r.status) for r in replies] == [(1, "ok"), (2, "rejected"), (3, "ok")]
    refused = replies[1]
    assert refused.grad is None and refused.reason.startswith(f"{TOO_STALE}: ")
    assert "version 1, 2 versions behind 3 (max 1)" in refused.reason
    assert (stats.too_stale, stats.batches_applied, stats.reloads) == (1, 3, 0)
    assert stats.dead_lettered["unknown_version"] == 1
    # The replica trained on, from version 1's server weights, on exactly the batches it took:
    # no reload on the newer versions.
    server, optimizer = reference_server(model, settings)
    expected = [
        weighted_step(server, optimizer, [batches[seq][0]], [batches[seq][1]], [1.0])
        for seq in (0, 1, 3)
    ]
    assert_close(replies[0].grad, expected[1].grads[0])
    assert_close(replies[2].grad, expected[2].grads[0])
    # Seeing version 3 made it checkpoint, rebased onto version 3 (nothing of its own was
    # folded yet: measured from where it started, so the weights are unchanged).
    assert stats.rebases == 1
    checkpoint = embedded.store.load_checkpoint(job, 0)
    assert checkpoint is not None and checkpoint.applied == 3
    assert checkpoint.meta["version"] == 3 and checkpoint.meta["anchor_applied"] == -1
    reference = server.state_dict()
    for name, tensor in checkpoint.weights.items():
        assert_close(tensor, reference[name], msg=name)


def test_round_markers_are_refused_in_async_mode(job: str) -> None:
    settings, embedded, model, client = setup(job)
    client.round_start(0, {"c0": 100})
    z, y = random_batch(model, torch.Generator().manual_seed(1))
    client.batch("c0", 0, z, y, version=1)
    client.round_end(0)

    stats = Worker(
        settings, Backends(settings.broker, settings.store, embedded), worker_id="w"
    ).run(threading.Event(), burst=True)

    assert stats.dead_lettered["no_rounds"] == 2 and stats.batches_applied == 1
    dead = client.broker
    dead.subscribe(dead_queue_name(job), prefetch=8)
    reasons = []
    while (delivery := dead.get(0.2)) is not None:
        dead.ack(delivery)
        reasons.append(str(delivery.headers.get(REASON_HEADER)))
    assert sorted(reasons) == [
        "no_rounds: RoundEnd in async mode",
        "no_rounds: RoundStart in async mode",
    ]


def test_a_copy_of_an_applied_batch_gets_its_gradient_again_in_async_mode(job: str) -> None:
    # A lost reply: the client publishes the batch again; the worker must not train on it
    # twice, nor answer without the gradient it computed. A worker taking over has none: "gone".
    settings, embedded, model, client = setup(job)
    gen = torch.Generator().manual_seed(4)
    batches = [random_batch(model, gen) for _ in range(3)]
    zero = client.batch("c0", 0, *batches[0], version=1)
    one = client.batch("c0", 1, *batches[1], version=1, round_=1)
    client.publish(0, one)  # republished
    client.publish(0, zero)  # an older seq: its gradient is not kept

    def burst(worker_id: str) -> Any:
        backends = Backends(settings.broker, settings.store, embedded)
        return Worker(settings, backends, worker_id=worker_id).run(threading.Event(), burst=True)

    first = burst("w1")
    client.publish(0, one)  # again, to a worker taking over
    client.batch("c0", 2, *batches[2], version=1, round_=2)
    second = burst("w2")

    replies = client.replies("c0")
    assert [(r.seq, r.status) for r in replies] == [
        (0, "ok"), (1, "ok"), (1, "ok"), (0, "gone"), (1, "gone"), (2, "ok"),
    ]  # fmt: skip
    server, optimizer = reference_server(model, settings)
    expected = [weighted_step(server, optimizer, [z], [y], [1.0]) for z, y in batches]
    assert_close(replies[1].grad, expected[1].grads[0])
    assert_close(replies[2].grad, expected[1].grads[0])
    assert replies[2].message_id != replies[1].message_id
    assert all(r.grad is None for r in replies[3:5])
    assert (first.batches_applied, first.duplicates_skipped, first.replies_resent) == (2, 2, 1)
    assert (first.gone_replies, second.gone_replies, second.batches_applied) == (1, 1, 1)
    assert_close(replies[5].grad, expected[2].grads[0])
