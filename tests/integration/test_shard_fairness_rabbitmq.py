"""Issue 33, the worker's side, over the real RabbitMQ and Redis: a client's flood on the shard
queue is refused beyond its credit (point 1), a forged seq far ahead cannot lock a client out
(point 2), and a message reusing an applied seq is dead-lettered with a reason unless it is a
copy of the applied batch (point 6).

A burst worker (it returns once the shard queue is empty and checkpointed) serves what a
scripted client and aggregator put on the queue; the members are the coordinator's records
with their sessions' `seq_base`; the dead letters are read off the dead-letter queue.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterator
from contextlib import closing
from dataclasses import dataclass

import pytest
import torch

from broker.messages import SmashedBatch, new_message_id
from broker.store import Checkpoint, WeightStore
from models.split import SplitNet
from services.common.backends import Backends
from services.common.membership import MemberInfo, member_id
from services.config.root import Settings
from services.runtime.processes import clear_job
from tests.unit.test_worker import dead_letters
from tests.unit.test_worker_support import (
    CUT,
    ScriptedClient,
    make_settings,
    one_torch_thread,
    random_batch,
    seed_version,
)
from workers.gate import StepRule
from workers.stats import WorkerStats
from workers.worker import Worker

__all__ = ["one_torch_thread"]  # the autouse fixture, imported so that it applies here

pytestmark = [pytest.mark.rabbitmq, pytest.mark.redis]

CLIENTS = ("a", "b", "mallory")
SAMPLES = 16  # two steps of 8 per round
BASES = {"a": 1_000, "b": 50_000, "mallory": 90_000}


@dataclass
class Shard:
    """Shard 0 of a job on the real servers: a version, the members, a scripted client."""

    settings: Settings
    backends: Backends
    store: WeightStore
    model: SplitNet
    client: ScriptedClient

    @property
    def job(self) -> str:
        return self.settings.job.name

    def open_round(self, seed: int) -> torch.Generator:
        """Round 0's RoundStart, every client in it; a generator of batches."""
        self.client.round_start(0, dict.fromkeys(CLIENTS, SAMPLES))
        return torch.Generator().manual_seed(seed)

    def run_burst(self) -> WorkerStats:
        worker = Worker(self.settings, self.backends, worker_id="w1")
        return worker.run(threading.Event(), burst=True)

    def checkpoint(self) -> Checkpoint:
        checkpoint = self.store.load_checkpoint(self.job, 0)
        assert checkpoint is not None
        return checkpoint


@pytest.fixture
def shard(job: str, amqp_url: str, redis_url: str) -> Iterator[Shard]:
    settings = make_settings(
        job,
        broker={"kind": "rabbitmq", "amqp_url": amqp_url},
        store={"kind": "redis", "redis_url": redis_url},
        algorithm={"batch_size": 8},
        workers={"lease_ttl_s": 10.0},
    )
    backends = Backends(settings.broker, settings.store)
    with closing(backends.open_store()) as store, closing(backends.open_broker("test")) as broker:
        model = seed_version(store, settings)
        for partition, name in enumerate(CLIENTS):
            info = MemberInfo(name, 0, CUT, SAMPLES, partition, seq_base=BASES[name])
            store.heartbeat(job, member_id(name), 60.0, info.to_info())
        client = ScriptedClient(broker, job)
        client.declare(list(CLIENTS))
        yield Shard(settings, backends, store, model, client)
    clear_job(settings, list(CLIENTS))


def test_a_forged_seq_far_ahead_is_refused_and_locks_nobody_out(shard: Shard) -> None:
    client, model, gen = shard.client, shard.model, shard.open_round(1)
    forged = 10**9
    for i in range(70):  # more than the replica's window of recent seqs
        client.batch("a", forged + i, *random_batch(model, gen, rows=1), step=0, steps=2)
    client.batch("a", BASES["a"], *random_batch(model, gen), step=0, steps=2)
    client.batch("a", BASES["a"] + 1, *random_batch(model, gen), step=1, steps=2)
    client.round_end(0)

    stats = shard.run_burst()

    replies = client.replies("a")
    assert [(r.seq, r.status) for r in replies] == [(BASES["a"], "ok"), (BASES["a"] + 1, "ok")]
    reasons = dead_letters(client, shard.job)
    assert len(reasons) == 70 and all(r.startswith("bad_seq: ") for r in reasons), reasons[:3]
    assert stats.batches_applied == 2
    assert shard.checkpoint().meta["seqs"] == {"a": BASES["a"] + 1}


def test_a_message_reusing_an_applied_seq_is_dead_lettered_and_a_copy_answered(
    shard: Shard,
) -> None:
    client, model, gen = shard.client, shard.model, shard.open_round(2)
    real = client.batch("a", BASES["a"], *random_batch(model, gen), step=0, steps=2)
    client.publish(0, real)  # a genuine copy: the client republished it
    for step in (0, 1, 1):  # forged: other contents, the same step, another step
        forged = SmashedBatch(
            job=shard.job,
            client="a",
            message_id=new_message_id(),
            version=1,
            seq=BASES["a"],
            shard=0,
            round=0,
            step=step,
            steps=2,
            activations=random_batch(model, gen)[0],
            labels=torch.zeros(8, dtype=torch.int64),
        )
        client.publish(0, forged)
    client.round_end(0)

    stats = shard.run_burst()

    reasons = dead_letters(client, shard.job)
    assert len(reasons) == 3 and all(r.startswith("seq_reused: ") for r in reasons), reasons
    replies = client.replies("a")
    assert [(r.seq, r.status) for r in replies] == [(BASES["a"], "ok")] * 2
    assert replies[1].grad is not None and replies[0].grad is not None
    assert torch.equal(replies[0].grad, replies[1].grad)
    assert (stats.batches_applied, stats.duplicates_skipped) == (1, 1)


def test_a_flooding_client_is_refused_beyond_its_credit_and_the_others_are_served(
    shard: Shard,
) -> None:
    client, model, gen = shard.client, shard.model, shard.open_round(3)
    flood = 200
    for i in range(flood):  # well-formed one-row batches with fresh seqs, from its session
        client.batch("mallory", BASES["mallory"] + i, *random_batch(model, gen, rows=1))
    for name in ("a", "b"):
        for step in range(2):
            client.batch(name, BASES[name] + step, *random_batch(model, gen), step=step, steps=2)
    client.round_end(0)

    stats = shard.run_burst()

    a = shard.settings.algorithm
    allowance = StepRule(a.batch_size, a.local_epochs, a.max_steps_per_round).allowance(SAMPLES)
    assert allowance < flood
    for name in ("a", "b"):
        assert [(r.seq, r.status) for r in client.replies(name)] == [
            (BASES[name], "ok"),
            (BASES[name] + 1, "ok"),
        ]
    assert len(client.replies("mallory")) == allowance
    assert stats.batches_applied == 4 + allowance
    reasons = dead_letters(client, shard.job)
    codes = Counter(r.split(":", 1)[0] for r in reasons)
    # Beyond its credit: refused unjudged, then its seqs run past the window as well.
    assert sum(codes.values()) == flood - allowance and set(codes) <= {"over_budget", "bad_seq"}
    assert codes["over_budget"] >= allowance, codes
    audit = shard.checkpoint().meta["audit"]
    assert audit["a"][0] == 2 and audit["b"][0] == 2
