"""A client numbers its batches from its Welcome's `seq_base`, one by one (issue 33, point 2),
against the scripted service side over the in-memory broker."""

from __future__ import annotations

import logging
import random
import threading
import time

import pytest
import torch

from broker.codec import encode
from broker.memory_broker import InMemoryBroker
from broker.messages import GradientReply, new_message_id
from broker.topology import REPLIES_EXCHANGE, dead_queue, reply_queue, reply_routing_key
from broker.transport import PublishOptions
from services.client.link import ClientLink
from services.client.plan import RoundPlan
from services.client.stats import ClientStats
from services.common.backends import Embedded
from services.data.loaders import Dataset, load_dataset
from tests.unit.test_bad_input import dead_letters
from tests.unit.test_client import run_client
from tests.unit.test_client_peers import PeerScript, make_settings, seeded_model

BASE = 1_765_000_000_000_000  # a Welcome's base: the coordinator's clock in µs


@pytest.fixture(scope="module")
def dataset() -> Dataset:
    return load_dataset("fashion_mnist_sample", env={})


def test_batches_run_from_the_welcomes_seq_base(job: str, dataset: Dataset) -> None:
    settings = make_settings(job)
    run = run_client(settings, dataset, PeerScript(rounds=2, seq_bases=(BASE,)))

    seqs = [seq for seq, _ in run.log.batches]
    steps = settings.algorithm.max_steps_per_round
    assert seqs == list(range(BASE, BASE + 2 * steps))
    assert run.stats.rounds == 2


def test_a_welcome_after_the_membership_expired_moves_the_seqs_up(
    job: str, dataset: Dataset
) -> None:
    """Forgotten (`unknown_member`), the client joins again; its new record's base is above
    every seq it used, and its batches go on from there."""
    settings = make_settings(job)
    script = PeerScript(forget_member=True, seq_bases=(BASE, BASE + 10**6))
    run = run_client(settings, dataset, script)

    seqs = [seq for seq, _ in run.log.batches]
    steps = settings.algorithm.max_steps_per_round
    assert run.log.welcomes >= 2
    assert seqs == list(range(BASE + 10**6, BASE + 10**6 + steps))


def test_replies_before_the_welcome_are_a_previous_process_duplicates(job: str) -> None:
    """A restarted client's reply queue may still hold answers to its previous process's
    batches: before its Welcome it has sent nothing, so they are duplicates, not dead letters."""
    embedded = Embedded()
    broker = InMemoryBroker(embedded.hub)
    broker.declare([dead_queue(job)])
    settings = make_settings(job)
    link = ClientLink(
        InMemoryBroker(embedded.hub),
        job=job,
        client="c0",
        stats=ClientStats(),
        stop=threading.Event(),
        clock=time.monotonic,
        logger=logging.getLogger("test.seq_base"),
        heartbeat_s=60.0,
        rng=random.Random(0),
        model=seeded_model(settings),
        plan=RoundPlan.from_settings(settings),
        reply=reply_queue(job, "c0"),
    )
    link.open()
    old = GradientReply(job, "c0", new_message_id(), 1, BASE, "ok", 0.1, 1, 2, torch.ones(2, 3))
    key = reply_routing_key(job, "c0")
    broker.publish(REPLIES_EXCHANGE, key, encode(old), PublishOptions(message_id="old"))

    assert link.poll(10.0) is not None
    assert dead_letters(broker, job) == {}
    link.begin(BASE + 5)
    assert (link.seq_base, link.next_seq) == (BASE + 5, BASE + 5)
    link.begin(BASE)  # an older Welcome, late: seqs never go back
    assert link.next_seq == BASE + 5
