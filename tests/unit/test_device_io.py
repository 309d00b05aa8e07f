"""The worker's data plane (`workers.device_io`) on the CPU: the prefetch path gives what the
plain path gives, in the same order; a refused body and a queue given back are handled in order.
The CUDA half (pinned buffers, the copy stream) runs where a device is lent:
tests/integration/test_cuda_worker.py."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest
import torch
from torch.testing import assert_close

from broker.codec import decode
from broker.memory_broker import InMemoryBroker, InMemoryHub
from broker.memory_store import InMemoryWeightStore
from broker.messages import Message, SmashedBatch
from broker.topology import job_queues, shard_queue_name
from models.parts import ServerModel
from services.algorithms.sfl import weighted_step
from tests.unit.test_worker_support import (
    ScriptedClient,
    make_settings,
    one_torch_thread,
    random_batch,
    reference_server,
    seed_version,
)
from workers.device_io import DevicePlane, Inbox, prefetches

__all__ = ["one_torch_thread"]  # the autouse fixture, imported so that it applies here

STEPS = 12
CPU = torch.device("cpu")


def queued(job: str, steps: int = STEPS) -> tuple[InMemoryHub, ServerModel, torch.optim.SGD]:
    """`steps` SmashedBatches of one client on shard 0's queue, and the server they train."""
    settings = make_settings(job)
    hub = InMemoryHub()
    model = seed_version(InMemoryWeightStore(), settings)
    client = ScriptedClient(InMemoryBroker(hub), job)
    client.declare(["c0"])
    gen = torch.Generator().manual_seed(3)
    for seq in range(steps):
        z, y = random_batch(model, gen)
        if seq % 3 == 1:
            z = z.to(torch.bfloat16)  # the wire's narrow format takes the same path
        client.batch("c0", seq, z, y, step=seq)
    server, optimizer = reference_server(model, settings)
    return hub, server, optimizer


def train(
    hub: InMemoryHub,
    job: str,
    server: ServerModel,
    optimizer: torch.optim.Optimizer,
    *,
    ahead: bool,
    decoder: Callable[[bytes], Message] = decode,
    device: torch.device = CPU,
) -> list[int]:
    """Step on every queued batch as the worker does; the seqs in the order they were served."""
    broker = InMemoryBroker(hub)
    broker.subscribe(shard_queue_name(job, 0), prefetch=4)
    plane = DevicePlane(device)
    server.to(device)
    inbox = Inbox(broker, plane, ahead=ahead, decoder=decoder)
    served: list[int] = []
    try:
        while (arrival := inbox.get(0.2)) is not None:
            batch = arrival.message
            assert isinstance(batch, SmashedBatch) and batch.labels is not None
            result = weighted_step(server, optimizer, [batch.activations], [batch.labels], [1.0])
            grad = plane.host(result.grads[0], batch.activations.dtype)
            assert grad.dtype == batch.activations.dtype and grad.is_contiguous()
            broker.ack(arrival.delivery)
            served.append(batch.seq)
    finally:
        inbox.close()
        broker.close()
    return served


def test_prefetch_path_trains_the_same_weights_as_the_plain_path(job: str) -> None:
    plain_hub, plain, plain_opt = queued(job)
    ahead_hub, ahead, ahead_opt = queued(job)
    threads: set[str] = set()

    def decoder(body: bytes) -> Message:
        threads.add(threading.current_thread().name)
        return decode(body)

    assert train(plain_hub, job, plain, plain_opt, ahead=False) == list(range(STEPS))
    assert train(ahead_hub, job, ahead, ahead_opt, ahead=True, decoder=decoder) == list(
        range(STEPS)
    )

    # Every body was decoded on the inbox's own thread, never on the stepping one.
    assert len(threads) == 1 and next(iter(threads)).startswith("splitmq-decode"), threads
    got = ahead.state_dict()
    for name, want in plain.state_dict().items():
        assert_close(got[name], want, rtol=0, atol=1e-6, msg=f"weight {name}")


def test_a_refused_body_comes_in_its_place(job: str) -> None:
    hub = InMemoryHub()
    broker = InMemoryBroker(hub)
    broker.declare(job_queues(job, 1))
    client = ScriptedClient(broker, job)
    z, y = torch.ones(2, 3), torch.zeros(2, dtype=torch.long)
    client.batch("c0", 0, z, y)
    client.publish(0, b"not a message")
    client.batch("c0", 1, z, y)
    broker.subscribe(shard_queue_name(job, 0), prefetch=8)
    inbox = Inbox(broker, DevicePlane(CPU), ahead=True)
    try:
        arrivals = [inbox.get(0.5) for _ in range(3)]
        assert inbox.get(0.05) is None
    finally:
        inbox.close()
    kinds = [(a.error is not None, getattr(a.message, "seq", None)) for a in arrivals if a]
    assert kinds == [(False, 0), (True, None), (False, 1)]


def test_a_queue_given_back_takes_its_prefetched_delivery_with_it(job: str) -> None:
    hub = InMemoryHub()
    broker = InMemoryBroker(hub)
    broker.declare(job_queues(job, 1))
    client = ScriptedClient(broker, job)
    for seq in range(3):
        client.batch("c0", seq, torch.full((1, 2), float(seq)), torch.zeros(1, dtype=torch.long))
    queue = shard_queue_name(job, 0)
    broker.subscribe(queue, prefetch=8)
    inbox = Inbox(broker, DevicePlane(CPU), ahead=True)
    try:
        first = inbox.get(0.5)  # seq 1 is decoded ahead meanwhile
        assert first is not None and getattr(first.message, "seq", None) == 0
        broker.ack(first.delivery)
        # What the worker does on a rollback: give the queue back and subscribe again.
        broker.unsubscribe(queue)
        inbox.forget(queue)
        broker.subscribe(queue, prefetch=8)
        rest = []
        while (arrival := inbox.get(0.2)) is not None:
            rest.append(getattr(arrival.message, "seq", None))
            broker.ack(arrival.delivery)
    finally:
        inbox.close()
    assert rest == [1, 2]  # once each, in order: none lost, none served from the stale copy


def test_the_cpu_plane_stages_nothing_and_copies_replies_to_the_wire_dtype() -> None:
    plane = DevicePlane(CPU)
    z = torch.randn(4, 3)
    batch = SmashedBatch("j", "c0", "m", 1, 0, 0, 0, 0, z, torch.zeros(4, dtype=torch.long))
    assert plane.ready(plane.stage(batch)) is batch
    strided = torch.randn(3, 4).t()
    out = plane.host(strided, torch.bfloat16)
    assert out.dtype == torch.bfloat16 and out.is_contiguous()
    assert_close(out, strided.to(torch.bfloat16))


@pytest.mark.parametrize(
    ("setting", "device", "expected"),
    [
        ("auto", "cpu", False),
        ("auto", "cuda", True),
        ("on", "cpu", True),
        ("off", "cuda", False),
    ],
)
def test_prefetch_setting(setting: str, device: str, expected: bool) -> None:
    assert prefetches(setting, torch.device(device)) is expected  # type: ignore[arg-type]


def test_the_plain_path_decodes_on_the_calling_thread(job: str) -> None:
    hub, server, optimizer = queued(job, steps=2)
    threads: set[str] = set()

    def decoder(body: bytes) -> Message:
        threads.add(threading.current_thread().name)
        return decode(body)

    assert train(hub, job, server, optimizer, ahead=False, decoder=decoder) == [0, 1]
    assert threads == {threading.current_thread().name}
