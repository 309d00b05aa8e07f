"""The worker's U-shaped step (docs/architecture.md, "U-shaped split") on the in-memory broker:
a step in two halves, a checkpoint taken while one is open, and a worker killed between them.

The expected weights and gradients come from plain autograd on a private copy of version 1's
server side (the blocks between the cut and the tail), not from `services.algorithms.ushape`.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
from torch.testing import assert_close

from broker.codec import decode
from broker.memory_broker import InMemoryBroker
from broker.messages import GradientReply, Message, ServerOutput, TailGradient, new_message_id
from broker.topology import REPLIES_EXCHANGE, reply_queue_name
from broker.transport import Broker, Delivery
from services.common.backends import Backends
from services.metrics.recorder import NO_METRICS
from tests.unit.test_worker import Killed, assert_same_weights, run_burst, setup
from tests.unit.test_worker_support import one_torch_thread, random_batch, reference_server
from workers.worker import Worker

__all__ = ["one_torch_thread"]  # the autouse fixture, imported so that it applies here

U_SHAPED = {"model": {"tail": "classifier"}}


class DiesWaiting:
    """An in-memory handle that is abandoned (closed unacked, the worker unwound) at the
    second `get` after `replies` replies went out (the first waits, so the worker's poll runs
    in between): a worker killed while it waits for a message."""

    def __init__(self, inner: InMemoryBroker, replies: int) -> None:
        self._inner = inner
        self._replies = replies
        self.sent = 0
        self._waited = False

    def publish(self, exchange: str, routing_key: str, body: bytes, *rest: Any) -> None:
        self._inner.publish(exchange, routing_key, body, *rest)
        self.sent += exchange == REPLIES_EXCHANGE

    def get(self, timeout: float) -> Delivery | None:
        if self.sent >= self._replies:
            if self._waited:
                self._inner.close()
                raise Killed
            self._waited = True
        return self._inner.get(timeout)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class DyingBackends:
    metrics = NO_METRICS

    def __init__(self, real: Backends, replies: int) -> None:
        self._real = real
        self._replies = replies

    def open_broker(self, name: str = "", **_: Any) -> Broker:
        inner = self._real.open_broker(name)
        assert isinstance(inner, InMemoryBroker)
        return DiesWaiting(inner, self._replies)  # type: ignore[return-value]

    def open_store(self) -> Any:
        return self._real.open_store()


def tail_gradient(job: str, seq: int, grad: torch.Tensor) -> TailGradient:
    return TailGradient(job, "c0", new_message_id(), 1, seq, 0, 0, grad)


def replies(broker: InMemoryBroker, job: str) -> list[Message]:
    queue = reply_queue_name(job, "c0")
    broker.subscribe(queue, prefetch=100)
    out = []
    while (delivery := broker.get(0.2)) is not None:
        broker.ack(delivery)
        out.append(decode(delivery.body))
    broker.unsubscribe(queue)
    return out


def reference_steps(
    model: Any, settings: Any, zs: list[torch.Tensor], grads: list[torch.Tensor]
) -> tuple[torch.nn.Module, list[torch.Tensor]]:
    """The server side after one U-shaped step per (z, dL/d output), and each dL/dz."""
    server, optimizer = reference_server(model, settings)
    dzs = []
    for z, g in zip(zs, grads, strict=True):
        z_in = z.clone().requires_grad_(True)
        out = server(z_in)
        # Its later cuts' heads (FedSplitX's) take no part.
        params = [p for n, p in server.named_parameters() if n.startswith("blocks.")]
        *param_grads, dz = torch.autograd.grad(out, [*params, z_in], g)
        for p, pg in zip(params, param_grads, strict=True):
            p.grad = pg
        optimizer.step()
        dzs.append(dz)
    return server, dzs


def test_a_step_in_two_halves_answers_the_output_then_dl_dz(job: str) -> None:
    settings, embedded, model, client = setup(job, ["c0"], **U_SHAPED)
    gen = torch.Generator().manual_seed(3)
    z, _ = random_batch(model, gen)
    client.round_start(0, {"c0": 8})
    client.batch("c0", 0, z, None)  # type: ignore[arg-type]
    grad = torch.randn(z.shape[0], *model.server_output_shape(), generator=gen)
    client.publish(0, tail_gradient(job, 0, grad))
    client.round_end(0)

    stats = run_burst(settings, embedded)

    output, reply = replies(client.broker, job)  # type: ignore[arg-type]
    server, dzs = reference_steps(model, settings, [z], [grad])
    assert isinstance(output, ServerOutput) and isinstance(reply, GradientReply)
    with torch.no_grad():
        assert_close(output.activations, reference_server(model, settings)[0](z))
    assert reply.status == "ok" and reply.grad is not None
    assert_close(reply.grad, dzs[0])
    assert stats.steps == 1 and stats.batches_applied == 1
    checkpoint = embedded.store.load_checkpoint(job, 0)
    assert checkpoint is not None and checkpoint.meta["seqs"] == {"c0": 0}
    assert_same_weights(checkpoint.weights, server)


def test_killed_between_the_two_halves_the_step_is_applied_once(job: str) -> None:
    """Step 1's forward is done and a checkpoint is taken while it is open (checkpoints every
    ms, and a replayed tail gradient of step 0 leaves a delivery to ack); the worker dies
    waiting for step 1's tail gradient. Its heir gets the batch back, forwards it again, takes
    the tail gradient the client sends, and applies the step once: the weights (BatchNorm's
    running statistics included) are those of exactly two steps."""
    settings, embedded, model, client = setup(
        job, ["c0"], workers={"checkpoint_every_s": 0.001, "lease_ttl_s": 0.6}, **U_SHAPED
    )
    gen = torch.Generator().manual_seed(5)
    zs = [random_batch(model, gen)[0] for _ in range(2)]
    grads = [torch.randn(z.shape[0], *model.server_output_shape(), generator=gen) for z in zs]
    client.round_start(0, {"c0": 16})
    client.batch("c0", 0, zs[0], None, step=0, steps=2)  # type: ignore[arg-type]
    client.publish(0, tail_gradient(job, 0, grads[0]))
    client.batch("c0", 1, zs[1], None, step=1, steps=2)  # type: ignore[arg-type]
    client.publish(0, tail_gradient(job, 0, grads[0]))  # a copy: answered again, held

    # Replies: output 0, gradient 0, output 1, gradient 0 again; then it waits, and dies.
    doomed = Worker(
        settings,
        DyingBackends(Backends(settings.broker, settings.store, embedded), 4),  # type: ignore[arg-type]
        worker_id="doomed",
    )
    with pytest.raises(Killed):
        doomed.run(threading.Event())
    at_death = embedded.store.load_checkpoint(job, 0)
    one_step, _ = reference_steps(model, settings, zs[:1], grads[:1])
    # The checkpoint taken while step 1 was open (it acked the copy): step 0 only, without
    # step 1's forward in BatchNorm's running statistics.
    assert at_death is not None and at_death.meta["seqs"] == {"c0": 0}
    assert_same_weights(at_death.weights, one_step)

    client.publish(0, tail_gradient(job, 1, grads[1]))  # the client answers output 1
    stats = run_burst(settings, embedded, worker_id="heir")

    server, dzs = reference_steps(model, settings, zs, grads)
    assert stats.batches_applied == 1 and stats.dead_lettered_total == 0
    checkpoint = embedded.store.load_checkpoint(job, 0)
    assert checkpoint is not None and checkpoint.applied == 2
    assert checkpoint.meta["seqs"] == {"c0": 1}
    assert_same_weights(checkpoint.weights, server)
    answers = replies(client.broker, job)  # type: ignore[arg-type]
    kinds = [
        (type(m).__name__, m.seq) for m in answers if isinstance(m, ServerOutput | GradientReply)
    ]
    assert kinds == [
        ("ServerOutput", 0),
        ("GradientReply", 0),
        ("ServerOutput", 1),
        ("GradientReply", 0),
        ("ServerOutput", 1),  # the heir's forward again (the client drops it)
        ("GradientReply", 1),
    ]
    last = answers[-1]
    assert isinstance(last, GradientReply) and last.status == "ok" and last.grad is not None
    assert_close(last.grad, dzs[1])
