"""The worker on the in-memory broker and store, driven by a scripted client and aggregator.

Every expected gradient and weight comes from `services.algorithms.sfl.weighted_step` run here on a
private copy of the same version-1 server weights: the worker must do exactly that math.
"""

from __future__ import annotations

import threading
from collections import Counter
from typing import Any

import pytest
import torch
from torch.testing import assert_close

from broker.memory_broker import InMemoryBroker
from broker.messages import GradientReply, new_message_id
from broker.topology import REPLIES_EXCHANGE, dead_queue_name, shard_queue_name
from broker.transport import REASON_HEADER, Broker, Delivery
from services.algorithms.sfl import weighted_step
from services.common.backends import Backends, Embedded
from services.metrics.recorder import NO_METRICS
from tests.unit.test_memory_broker import drained
from tests.unit.test_worker_support import (
    ScriptedClient,
    make_settings,
    one_torch_thread,
    random_batch,
    reference_server,
    seed_version,
)
from workers.worker import Worker

__all__ = ["one_torch_thread"]  # the autouse fixture, imported so that it applies here


def backends(settings: Any, embedded: Embedded) -> Backends:
    return Backends(settings.broker, settings.store, embedded)


def setup(job: str, clients: list[str], **sections: Any) -> tuple[Any, Embedded, Any, Any]:
    settings = make_settings(job, **sections)
    embedded = Embedded()
    model = seed_version(embedded.store, settings)
    client = ScriptedClient(InMemoryBroker(embedded.hub), job, settings.shards)
    client.declare(clients)
    return settings, embedded, model, client


def run_burst(settings: Any, embedded: Embedded, worker_id: str = "w1") -> Any:
    return Worker(settings, backends(settings, embedded), worker_id=worker_id).run(
        threading.Event(), burst=True
    )


def assert_same_weights(got: Any, server: torch.nn.Module) -> None:
    expected = server.state_dict()
    assert got, "checkpoint holds no weights"
    for name, tensor in got.items():
        assert_close(tensor, expected[name], msg=f"weight {name}")


def test_round_gives_the_sequential_gradients_and_a_checkpoint(job: str) -> None:
    settings, embedded, model, client = setup(job, ["c0"])
    gen = torch.Generator().manual_seed(1)
    batches = [random_batch(model, gen) for _ in range(5)]
    # One batch travels as float16: its gradient must come back as float16.
    batches[2] = (batches[2][0].to(torch.float16), batches[2][1])
    client.round_start(0, {"c0": 40})
    for seq, (z, y) in enumerate(batches):
        client.batch("c0", seq, z, y, step=seq, steps=len(batches))
    client.round_end(0)

    stats = run_burst(settings, embedded)

    replies = client.replies("c0")
    server, optimizer = reference_server(model, settings)
    assert [r.seq for r in replies] == list(range(5))
    for (z, y), reply in zip(batches, replies, strict=True):
        expected = weighted_step(server, optimizer, [z], [y], [1.0])
        assert reply.status == "ok" and reply.samples == 8 and reply.version == 1
        assert reply.grad is not None and reply.grad.dtype == z.dtype
        assert_close(reply.grad, expected.grads[0].to(z.dtype))
        assert reply.loss == pytest.approx(expected.losses[0], rel=1e-5)
        assert reply.correct == expected.correct[0]
    checkpoint = embedded.store.load_checkpoint(job, 0)
    assert checkpoint is not None
    assert checkpoint.applied == 5
    assert checkpoint.meta["round"] == 0
    assert checkpoint.meta["round_samples"] == 40
    assert checkpoint.meta["seqs"] == {"c0": 4}
    assert checkpoint.meta["version"] == 1
    assert_same_weights(checkpoint.weights, server)
    assert (stats.batches_applied, stats.steps, stats.replies) == (5, 5, 5)
    assert stats.duplicates_skipped == 0 and stats.dead_lettered_total == 0
    # Everything acked: nothing ready, nothing unacknowledged on the shard queue.
    assert drained(embedded.hub, 1.0, queues=[shard_queue_name(job, 0)])


def test_folded_messages_take_one_step_over_their_rows(job: str) -> None:
    settings, embedded, model, client = setup(job, ["c0"], workers={"batch_messages": 3})
    gen = torch.Generator().manual_seed(2)
    batches = [random_batch(model, gen, rows=4 + i) for i in range(5)]
    client.round_start(0, {"c0": 30})
    for seq, (z, y) in enumerate(batches):
        client.batch("c0", seq, z, y)
    client.round_end(0)

    stats = run_burst(settings, embedded)

    replies = client.replies("c0")
    server, optimizer = reference_server(model, settings)
    grads: list[torch.Tensor] = []
    for group in (batches[:3], batches[3:]):  # all were queued: folded 3, then the rest
        zs, ys = [z for z, _ in group], [y for _, y in group]
        rows = [float(y.shape[0]) for y in ys]
        grads += weighted_step(server, optimizer, zs, ys, rows, concat=True).grads
    assert stats.steps == 2 and stats.batches_applied == 5
    for reply, grad in zip(replies, grads, strict=True):
        assert reply.grad is not None
        assert_close(reply.grad, grad)
    checkpoint = embedded.store.load_checkpoint(job, 0)
    assert checkpoint is not None and checkpoint.applied == 5
    assert_same_weights(checkpoint.weights, server)


def test_duplicate_seqs_are_never_applied_twice(job: str) -> None:
    settings, embedded, model, client = setup(job, ["c0"])
    gen = torch.Generator().manual_seed(3)
    batches = [random_batch(model, gen) for _ in range(4)]
    client.round_start(0, {"c0": 32})
    client.batch("c0", 0, *batches[0])
    one = client.batch("c0", 1, *batches[1])
    client.publish(0, one)  # the client republished after a reply timeout
    two = client.batch("c0", 2, *batches[2])
    first = run_burst(settings, embedded)
    # A later worker resumes from the checkpoint: an old seq is still a duplicate.
    client.publish(0, two)
    client.batch("c0", 3, *batches[3])
    client.round_end(0)
    second = run_burst(settings, embedded, worker_id="w2")

    assert (first.batches_applied, first.duplicates_skipped) == (3, 1)
    assert (second.batches_applied, second.duplicates_skipped) == (1, 1)
    replies = client.replies("c0")
    # The copy of seq 1 gets its gradient again (its reply may have been lost); the worker
    # that took over has no gradient for seq 2 and says so ("gone"), it does not say "wait".
    assert [(r.seq, r.status) for r in replies] == [
        (0, "ok"), (1, "ok"), (1, "ok"), (2, "ok"), (2, "gone"), (3, "ok"),
    ]  # fmt: skip
    original, again = replies[1], replies[2]
    assert again.message_id != original.message_id
    assert original.grad is not None and again.grad is not None
    assert torch.equal(again.grad, original.grad)
    assert (again.loss, again.samples, again.version) == (
        original.loss, original.samples, original.version
    )  # fmt: skip
    assert (first.replies_resent, first.gone_replies) == (1, 0)
    assert (second.replies_resent, second.gone_replies) == (0, 1)
    assert replies[4].grad is None and "seq 2 was already applied" in replies[4].reason
    server, optimizer = reference_server(model, settings)
    for z, y in batches:
        weighted_step(server, optimizer, [z], [y], [1.0])
    checkpoint = embedded.store.load_checkpoint(job, 0)
    assert checkpoint is not None and checkpoint.applied == 4
    assert checkpoint.meta["seqs"] == {"c0": 3}
    assert_same_weights(checkpoint.weights, server)


def dead_letters(client: ScriptedClient, job: str) -> list[str]:
    queue = dead_queue_name(job)
    count = client.broker.queue_depth(queue)
    client.broker.subscribe(queue, prefetch=50)
    reasons = []
    for _ in range(count):
        delivery = client.broker.get(5.0)
        assert delivery is not None
        reasons.append(str(delivery.headers[REASON_HEADER]))
        client.broker.ack(delivery)
    client.broker.unsubscribe(queue)
    return reasons


def test_bad_messages_are_dead_lettered_and_the_rest_still_served(job: str) -> None:
    settings, embedded, model, client = setup(job, ["c0", "x"])
    gen = torch.Generator().manual_seed(4)
    z, y = random_batch(model, gen)
    client.round_start(0, {"c0": 16})
    client.publish(0, b"not a message at all")
    client.batch("c0", 0, torch.zeros(8, 3, 3, 3), y)  # not the cut's shape
    client.batch("c0", 0, z, y, job="some-other-job")
    client.batch("c0", 0, z, torch.full((8,), 10))  # cnn5 has classes 0..9
    client.batch("c0", 0, z, y, shard=3, to=0)  # names another shard
    client.batch("x", 0, z, y)  # not in round 0's cohort
    client.publish(0, GradientReply(job, "c0", new_message_id(), 1, 0, "ok", 0.0, 0, 8, z))
    client.batch("c0", 0, z, y)  # valid, after all of that
    client.batch("c0", 1, z, y)
    client.round_end(0)

    stats = run_burst(settings, embedded)

    codes = [reason.split(":", 1)[0] for reason in dead_letters(client, job)]
    expected = ["decode", "bad_shape", "wrong_job", "bad_labels", "wrong_shard",
                "not_in_cohort", "wrong_type"]  # fmt: skip
    assert codes == expected
    assert stats.dead_lettered == Counter(expected)
    assert stats.batches_applied == 2
    assert [r.seq for r in client.replies("c0")] == [0, 1]
    checkpoint = embedded.store.load_checkpoint(job, 0)
    assert checkpoint is not None and checkpoint.applied == 2 and checkpoint.meta["round"] == 0


def test_minibatch_sfl_barrier_is_one_weighted_step_per_step_index(job: str) -> None:
    cohort = {"a": 100, "b": 200, "c": 300}
    settings, embedded, model, client = setup(
        job, list(cohort), algorithm={"name": "minibatch_sfl"}
    )
    gen = torch.Generator().manual_seed(5)
    data = {(c, step): random_batch(model, gen) for step in range(2) for c in cohort}
    client.round_start(0, cohort)
    # Arrival order differs per step; the barrier must not care.
    for client_id, step in [("a", 0), ("b", 0), ("c", 0), ("c", 1), ("b", 1), ("a", 1)]:
        client.batch(client_id, step, *data[client_id, step], step=step, steps=2)
    client.round_end(0)

    stats = run_burst(settings, embedded)

    server, optimizer = reference_server(model, settings)
    expected: dict[tuple[str, int], torch.Tensor] = {}
    for step in range(2):
        zs = [data[c, step][0] for c in cohort]
        ys = [data[c, step][1] for c in cohort]
        result = weighted_step(server, optimizer, zs, ys, [float(p) for p in cohort.values()])
        expected.update({(c, step): g for c, g in zip(cohort, result.grads, strict=True)})
    assert stats.steps == 2 and stats.batches_applied == 6
    for client_id in cohort:
        replies = client.replies(client_id)
        assert [r.seq for r in replies] == [0, 1]
        for step, reply in enumerate(replies):
            assert reply.grad is not None
            assert_close(reply.grad, expected[client_id, step])
    checkpoint = embedded.store.load_checkpoint(job, 0)
    assert checkpoint is not None and checkpoint.applied == 6
    assert checkpoint.meta["round_samples"] == 6 * 8
    assert_same_weights(checkpoint.weights, server)


def test_barrier_stops_waiting_for_a_missing_client(job: str) -> None:
    cohort = {"a": 100, "b": 200, "c": 300}
    settings, embedded, model, client = setup(
        job,
        list(cohort),
        algorithm={"name": "minibatch_sfl"},
        workers={"step_barrier_timeout_s": 0.3},
    )
    gen = torch.Generator().manual_seed(6)
    data = {(c, step): random_batch(model, gen) for step in range(2) for c in ("a", "b")}
    client.round_start(0, cohort)
    for step in range(2):
        for client_id in ("a", "b"):  # "c" never sends anything
            client.batch(client_id, step, *data[client_id, step], step=step, steps=2)

    stats = run_burst(settings, embedded)

    replies = {c: client.replies(c) for c in ("a", "b")}
    server, optimizer = reference_server(model, settings)
    for step in range(2):
        zs = [data[c, step][0] for c in ("a", "b")]
        ys = [data[c, step][1] for c in ("a", "b")]
        result = weighted_step(server, optimizer, zs, ys, [100.0, 200.0])
        for client_id, grad in zip(("a", "b"), result.grads, strict=True):
            reply = replies[client_id][step]
            assert reply.seq == step and reply.grad is not None
            assert_close(reply.grad, grad)
    assert stats.steps == 2 and stats.batches_applied == 4
    checkpoint = embedded.store.load_checkpoint(job, 0)
    assert checkpoint is not None and checkpoint.applied == 4
    assert_same_weights(checkpoint.weights, server)


class Killed(BaseException):
    """What SIGKILL is to a process: nothing of the worker's own cleanup runs."""


class KillingBroker:
    """Delegates to a real in-memory handle until the kill point, then abandons it: closes it
    without acking (its unacked deliveries return to the queue) and unwinds the worker."""

    def __init__(self, inner: InMemoryBroker, *, after_replies: int = 0, at_ack: int = 0):
        self._inner = inner
        self._after_replies = after_replies
        self._at_ack = at_ack
        self.replies = 0
        self.acks = 0

    def publish(self, exchange: str, routing_key: str, body: bytes, *rest: Any) -> None:
        if exchange == REPLIES_EXCHANGE:
            self.replies += 1
            if self.replies == self._after_replies:
                self._die()
        self._inner.publish(exchange, routing_key, body, *rest)

    def ack(self, delivery: Delivery) -> None:
        self.acks += 1
        if self.acks == self._at_ack:
            self._die()
        self._inner.ack(delivery)

    def _die(self) -> None:
        self._inner.close()
        raise Killed

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class KillingBackends:
    metrics = NO_METRICS  # as Backends without metrics

    def __init__(self, real: Backends, **kill: int) -> None:
        self._real = real
        self._kill = kill

    def open_broker(self, name: str = "", **_: Any) -> Broker:
        inner = self._real.open_broker(name)
        assert isinstance(inner, InMemoryBroker)
        return KillingBroker(inner, **self._kill)

    def open_store(self) -> Any:
        return self._real.open_store()


# RoundStart and batches 0-2 are acked by the first checkpoint (4 acks); dying at ack 6 leaves
# a second checkpoint (seqs up to 5) whose batches 4 and 5 are still unacked: redelivered, they
# must be recognised as duplicates. Dying at reply 8 loses batches 6 and 7 after the second
# checkpoint: redelivered, they must be applied again.
@pytest.mark.parametrize("kill", [{"after_replies": 8}, {"at_ack": 6}], ids=["reply", "ack"])
def test_killed_worker_resumes_from_checkpoint_exactly_once(job: str, kill: dict[str, int]) -> None:
    settings, embedded, model, client = setup(job, ["c0"])
    gen = torch.Generator().manual_seed(7)
    batches = [random_batch(model, gen) for _ in range(10)]
    client.round_start(0, {"c0": 80})
    for seq, (z, y) in enumerate(batches):
        client.batch("c0", seq, z, y, step=seq, steps=10)
    client.round_end(0)

    doomed = Worker(
        settings,
        KillingBackends(backends(settings, embedded), **kill),  # type: ignore[arg-type]
        worker_id="doomed",
    )
    with pytest.raises(Killed):
        doomed.run(threading.Event())
    at_death = embedded.store.load_checkpoint(job, 0)
    assert at_death is not None and 0 < at_death.applied < 10

    # The successor waits for the dead worker's lease to expire, then takes the shard over.
    stats = run_burst(settings, embedded, worker_id="heir")

    assert stats.batches_applied == 10 - at_death.applied
    if "at_ack" in kill:
        assert stats.duplicates_skipped >= 1  # checkpointed but unacked: redelivered, skipped
    checkpoint = embedded.store.load_checkpoint(job, 0)
    assert checkpoint is not None
    assert checkpoint.applied == 10 and checkpoint.meta["seqs"] == {"c0": 9}
    assert checkpoint.meta["round"] == 0 and checkpoint.meta["round_samples"] == 80
    server, optimizer = reference_server(model, settings)
    for z, y in batches:  # each batch exactly once, in order
        weighted_step(server, optimizer, [z], [y], [1.0])
    assert_same_weights(checkpoint.weights, server)
    assert drained(embedded.hub, 1.0, queues=[shard_queue_name(job, 0)])


def test_a_poisoned_step_is_rolled_back_and_the_rest_applied_once(job: str) -> None:
    settings, embedded, model, client = setup(job, ["c0"])
    gen = torch.Generator().manual_seed(8)
    good = [random_batch(model, gen) for _ in range(3)]
    huge = torch.full_like(good[0][0], 3e38)  # finite on the wire, overflows in the server
    client.round_start(0, {"c0": 24})
    client.batch("c0", 0, *good[0])
    client.batch("c0", 1, *good[1])
    client.batch("c0", 2, huge, good[0][1])
    client.batch("c0", 3, *good[2])
    client.round_end(0)

    stats = run_burst(settings, embedded)

    assert stats.rollbacks == 1
    assert stats.dead_lettered == Counter({"non_finite": 1})
    assert [r.split(":", 1)[0] for r in dead_letters(client, job)] == ["non_finite"]
    # Seqs 0 and 1 were served twice (before and after the rollback); the replica holds each
    # once, in order, and seq 3 after them.
    assert [r.seq for r in client.replies("c0")] == [0, 1, 0, 1, 3]
    server, optimizer = reference_server(model, settings)
    for z, y in good:
        weighted_step(server, optimizer, [z], [y], [1.0])
    checkpoint = embedded.store.load_checkpoint(job, 0)
    assert checkpoint is not None and checkpoint.applied == 3
    assert checkpoint.meta["seqs"] == {"c0": 3}
    assert_same_weights(checkpoint.weights, server)


def test_a_copy_of_a_buffered_batch_is_served_once(job: str) -> None:
    cohort = {"a": 10, "b": 20}
    settings, embedded, model, client = setup(
        job, list(cohort), algorithm={"name": "minibatch_sfl"}
    )
    gen = torch.Generator().manual_seed(9)
    za, ya = random_batch(model, gen)
    zb, yb = random_batch(model, gen)
    client.round_start(0, cohort)
    first = client.batch("a", 0, za, ya, steps=1)
    client.publish(0, first)  # republished while the barrier waits for b
    client.batch("b", 0, zb, yb, steps=1)
    client.round_end(0)

    stats = run_burst(settings, embedded)

    assert (stats.steps, stats.batches_applied, stats.duplicates_skipped) == (1, 2, 1)
    assert [(r.seq, r.status) for r in client.replies("a")] == [(0, "ok")]
    server, optimizer = reference_server(model, settings)
    weighted_step(server, optimizer, [za, zb], [ya, yb], [10.0, 20.0])
    checkpoint = embedded.store.load_checkpoint(job, 0)
    assert checkpoint is not None and checkpoint.applied == 2
    assert_same_weights(checkpoint.weights, server)
    assert drained(embedded.hub, 1.0, queues=[shard_queue_name(job, 0)])  # both copies acked


def test_worker_idles_on_an_algorithm_without_a_server_side(job: str) -> None:
    from services.common.backends import Backends, Embedded
    from services.config.loading import load_settings
    from workers.worker import Worker

    settings = load_settings(None, {"SPLITMQ_JOB__NAME": job, "SPLITMQ_ALGORITHM__NAME": "fedavg"})
    stop = threading.Event()
    worker = Worker(settings, Backends(settings.broker, settings.store, Embedded()))
    result: list[object] = []
    thread = threading.Thread(target=lambda: result.append(worker.run(stop)))
    thread.start()
    thread.join(0.5)
    assert thread.is_alive()  # idling, not crashed
    stop.set()
    thread.join(10)
    assert not thread.is_alive()
    assert result and result[0].batches_applied == 0  # type: ignore[attr-defined]
