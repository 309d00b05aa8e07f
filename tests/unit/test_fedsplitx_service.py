"""FedSplitX through the service's pieces: the batch's cut on the wire and at the worker, the
replica's rows per cut, and the coordinator's level assignment."""

from __future__ import annotations

import logging

import pytest
import torch

from broker.codec import decode, encode
from broker.errors import EncodeError
from broker.memory_store import InMemoryWeightStore
from broker.messages import Join, SmashedBatch, new_message_id
from broker.transport import Delivery
from services.aggregator.rounds import replica_of
from services.common.jobmodel import job_hyper, job_model
from services.coordinator.joining import LevelDesk
from services.coordinator.welcomes import REWELCOME_S
from tests.unit.test_coordinator import Desk, settings_for
from tests.unit.test_worker_support import make_settings, seed_version
from workers.replica import Replica, open_replica
from workers.shard_checks import BatchContent, ShardExpectations

LEVEL2_SHAPE = (20, 4, 4)  # cnn5 after block2


def batch(cut: str, shape: tuple[int, ...]) -> SmashedBatch:
    return SmashedBatch(
        job="j",
        client="a",
        message_id="m",
        version=1,
        seq=0,
        shard=0,
        round=0,
        step=0,
        activations=torch.zeros(4, *shape),
        labels=torch.zeros(4, dtype=torch.int64),
        cut=cut,
    )


def test_the_cut_travels_and_a_malformed_one_is_refused() -> None:
    decoded = decode(encode(batch("block2", LEVEL2_SHAPE)))
    assert isinstance(decoded, SmashedBatch) and decoded.cut == "block2"
    assert isinstance(decode(encode(batch("", LEVEL2_SHAPE))), SmashedBatch)
    with pytest.raises(EncodeError, match="not a cut name"):
        encode(batch("block2.fc", LEVEL2_SHAPE))


def test_worker_checks_the_shape_of_the_batchs_own_cut() -> None:
    want = ShardExpectations(
        job="j",
        shard=0,
        cut_shape=(10, 12, 12),
        num_classes=10,
        cut="block1",
        other_cuts={"block2": LEVEL2_SHAPE, "block3": (50,)},
    )
    check = BatchContent(want)
    delivery = Delivery(body=b"", queue="q", routing_key="q", tag=1)
    assert check(delivery, batch("block1", (10, 12, 12))) is None
    assert check(delivery, batch("", (10, 12, 12))) is None  # the job's cut
    assert check(delivery, batch("block2", LEVEL2_SHAPE)) is None
    assert check(delivery, batch("block3", (50,))) is None
    problem = check(delivery, batch("block2", (10, 12, 12)))
    assert problem is not None and problem.code == "bad_shape"
    problem = check(delivery, batch("classifier", (10,)))
    assert problem is not None and problem.code == "bad_cut"


def test_replica_counts_rows_per_cut_through_its_checkpoint(job: str) -> None:
    settings = make_settings(job)
    store = InMemoryWeightStore()
    template = job_model(settings)
    hyper = job_hyper(settings)

    def make() -> Replica:
        return Replica(0, template, "block1", hyper.server_optimizer, torch.device("cpu"))

    seed_version(store, settings)
    replica = open_replica(store, job, make, logging.getLogger())
    assert replica is not None
    replica.record("a", seq=1, step=0, steps=2, rows=8)  # from the replica's own cut
    replica.record("b", seq=1, step=0, steps=2, rows=5, cut="block2")
    replica.record("b", seq=2, step=1, steps=2, rows=5, cut="block2")
    store.save_checkpoint(job, replica.checkpoint())
    saved = store.load_checkpoint(job, 0)
    assert saved is not None
    handed = replica_of(saved)
    assert handed.samples == 18 and dict(handed.cut_samples) == {"block1": 8, "block2": 10}
    resumed = open_replica(store, job, make, logging.getLogger())
    assert resumed is not None and resumed.cut_samples == {"block1": 8, "block2": 10}
    resumed.end_round(0)
    resumed.start_counting()
    assert resumed.cut_samples == {} and resumed.round_samples == 0


def test_level_desk_by_capability_then_mix_then_default(job: str) -> None:
    fsx = settings_for(
        job,
        algorithm={"name": "fedsplitx", "fedsplitx": {"default_level": 2}},
        clients={"count": 3, "capability_mix": "1,0,2"},
    )
    desk = LevelDesk(fsx)
    assert desk.cuts == ("block1", "block2", "block3")
    assert desk.cut(0, 0) == "block1"  # the mix: partition 0 has capability 1
    assert desk.cut(0, 2) == "block3"
    assert desk.cut(2, 0) == "block2"  # a declared capability wins
    assert desk.cut(9, 0) == "block3"  # capped at the deepest level
    no_mix = settings_for(job, algorithm={"name": "fedsplitx", "fedsplitx": {"default_level": 2}})
    assert LevelDesk(no_mix).cut(0, 0) == "block2"  # the default
    lls = settings_for(job, algorithm={"name": "local_loss_sfl"}, model={"cut": "block2"})
    assert LevelDesk(lls).cuts == ("block2",) and LevelDesk(lls).cut(3, 0) == "block2"
    assert LevelDesk(settings_for(job)).cuts == ("block1",)  # sfl_v2: the job's cut


def test_coordinator_welcomes_each_client_at_its_level(job: str) -> None:
    settings = settings_for(
        job,
        algorithm={"name": "fedsplitx"},
        clients={"count": 3, "capability_mix": "1,1,1"},
    )
    desk = Desk(settings)
    with desk.serving():
        desk.send(Join(job, "a", new_message_id(), 0, 50, 0, {"index": "0"}))
        a = desk.welcome("a")
        desk.send(Join(job, "b", new_message_id(), 0, 50, 3, {"index": "1"}))
        b = desk.welcome("b")
        desk.send(Join(job, "c", new_message_id(), 0, 50, 0, {}))  # given partition 2
        c = desk.welcome("c")
        desk.clock.advance(REWELCOME_S)  # welcomed again only after the interval
        desk.send(Join(job, "a", new_message_id(), 0, 50, 3, {"index": "0"}))  # re-join
        again = desk.welcome("a")
    assert (a.cut, a.config["level"]) == ("block1", 1)
    assert (b.cut, b.config["level"]) == ("block3", 3)
    assert (c.cut, c.config["level"], c.config["partition"]) == ("block3", 3, 2)
    assert again.cut == "block1"  # a member keeps its record
    assert desk.member("b").cut == "block3"
