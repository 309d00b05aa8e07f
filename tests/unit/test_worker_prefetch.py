"""A worker that decodes one delivery ahead (`workers.prefetch = "on"`, workers/device_io.py)
does exactly what one that does not does, on the CPU: the same replies in the same order, the
same checkpointed weights, and a rollback that gives its queue back takes the delivery decoded
ahead with it."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
import torch

from broker.messages import Message
from tests.unit.test_client_peers import max_diff
from tests.unit.test_worker import dead_letters, run_burst, setup
from tests.unit.test_worker_support import one_torch_thread, random_batch
from workers import device_io

__all__ = ["one_torch_thread"]  # the autouse fixture, imported so that it applies here


@pytest.fixture
def decode_threads(monkeypatch: pytest.MonkeyPatch) -> set[str]:
    """The names of the threads that decoded a body."""
    seen: set[str] = set()
    real: Callable[[bytes], Message] = device_io.decode

    def recording(body: bytes) -> Message:
        seen.add(threading.current_thread().name)
        return real(body)

    monkeypatch.setattr(device_io, "decode", recording)
    return seen


def two_clients_round(job: str, prefetch: str, seed: int = 4) -> tuple[Any, Any, Any]:
    """One round of two clients' interleaved batches served by a burst worker: (stats, the
    replies by client as (seq, loss, grad), the checkpoint)."""
    settings, embedded, model, client = setup(
        job, ["c0", "c1"], workers={"prefetch": prefetch, "checkpoint_every_steps": 4}
    )
    gen = torch.Generator().manual_seed(seed)
    client.round_start(0, {"c0": 48, "c1": 48})
    for seq in range(6):
        for name in ("c0", "c1"):
            z, y = random_batch(model, gen)
            client.batch(name, seq, z if seq % 2 else z.to(torch.bfloat16), y, step=seq)
    client.round_end(0)
    stats = run_burst(settings, embedded)
    replies = {
        name: [(r.seq, r.loss, r.grad) for r in client.replies(name)] for name in ("c0", "c1")
    }
    return stats, replies, embedded.store.load_checkpoint(job, 0)


def test_decoding_ahead_serves_what_the_plain_path_serves(
    job: str, decode_threads: set[str]
) -> None:
    plain_stats, plain_replies, plain_saved = two_clients_round(f"{job}p", "off")
    assert decode_threads == {threading.current_thread().name}  # burst: run on this thread
    decode_threads.clear()
    ahead_stats, ahead_replies, ahead_saved = two_clients_round(f"{job}a", "on")

    assert decode_threads and all(t.startswith("splitmq-decode") for t in decode_threads)
    assert (ahead_stats.batches_applied, ahead_stats.steps) == (12, 12)
    assert ahead_stats.dead_lettered_total == plain_stats.dead_lettered_total == 0
    for name, want in plain_replies.items():
        got = ahead_replies[name]
        assert [seq for seq, _, _ in got] == [seq for seq, _, _ in want] == list(range(6))
        for (_, loss, grad), (_, loss_want, grad_want) in zip(got, want, strict=True):
            assert grad is not None and grad_want is not None and grad.dtype == grad_want.dtype
            assert abs(loss - loss_want) <= 1e-6
            assert max_diff({"g": grad}, {"g": grad_want}) <= 1e-6
    assert plain_saved is not None and ahead_saved is not None
    assert ahead_saved.applied == plain_saved.applied == 12
    assert max_diff(ahead_saved.weights, plain_saved.weights) <= 1e-6


def test_a_rollback_drops_the_delivery_decoded_ahead(job: str) -> None:
    settings, embedded, model, client = setup(
        job, ["c0"], workers={"prefetch": "on", "checkpoint_every_steps": 2}
    )
    gen = torch.Generator().manual_seed(8)
    good = [random_batch(model, gen) for _ in range(3)]
    huge = torch.full_like(good[0][0], 3e38)  # finite on the wire, overflows in the server
    client.round_start(0, {"c0": 24})
    client.batch("c0", 0, *good[0])
    client.batch("c0", 1, *good[1])  # the checkpoint after it holds the cohort
    client.batch("c0", 2, huge, good[0][1])
    client.batch("c0", 3, *good[2])  # decoded ahead while seq 2 poisons the replica
    client.round_end(0)

    stats = run_burst(settings, embedded)

    assert stats.rollbacks == 1
    assert stats.dead_lettered == Counter({"non_finite": 1})
    assert [r.split(":", 1)[0] for r in dead_letters(client, job)] == ["non_finite"]
    # Seq 3 is served once, from its redelivery: the copy decoded before the rollback went back
    # with the queue (served, it would be answered twice and acked on a dead delivery).
    assert [r.seq for r in client.replies("c0")] == [0, 1, 3]
    assert (stats.duplicates_skipped, stats.stale_acks) == (0, 0)
    checkpoint = embedded.store.load_checkpoint(job, 0)
    assert checkpoint is not None and checkpoint.applied == 3
    assert checkpoint.meta["seqs"] == {"c0": 3}
