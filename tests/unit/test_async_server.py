"""Async mode's server side: the aggregator's fold of continuously training shard replicas
(`ServerLedger`) and the replicas' rebasing onto the versions it publishes
(`workers.clock.Continuous`), over the in-memory store with real cnn5 replicas. Progress is
counted once, wherever it was made, whatever order folds and rebases come in."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest
import torch
from torch.testing import assert_close

from broker.memory_store import InMemoryWeightStore
from broker.messages import SmashedBatch, new_message_id
from broker.store import CLIENT_PART, SERVER_PART, BlobRef, Checkpoint
from services.aggregator.core import read_version
from services.algorithms.async_fold import StaleUpdate, fold, is_statistic
from services.algorithms.averaging import weighted_average
from services.algorithms.base import ClientUpdate
from services.algorithms.registry import build_strategy
from services.algorithms.staleness import TOO_STALE, StalenessRule
from services.common.jobmodel import job_hyper
from services.common.server_fold import FoldedCheckpoint, ServerLedger, folded_of
from tests.unit.test_worker_support import make_settings, seed_version
from workers.clock import Continuous
from workers.replica import Replica, open_replica
from workers.stats import WorkerStats

SERVER = BlobRef(SERVER_PART)
CLIENT = BlobRef(CLIENT_PART)
LOG = logging.getLogger("test.async.server")


@pytest.fixture(autouse=True)
def one_torch_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


class Setup:
    """Version 1 of a cnn5 job with S shards, a ledger, and one async replica per shard."""

    def __init__(self, job: str, shards: int) -> None:
        self.settings = make_settings(job, algorithm={"name": "sfl", "shards": shards})
        self.job = job
        self.store = InMemoryWeightStore(keep_versions=20)
        self.template = seed_version(self.store, self.settings)
        self.strategy = build_strategy("sfl")
        self.ledger = ServerLedger(self.store, job, shards, LOG)
        self.stats = WorkerStats()
        self.replicas = [self.open(s) for s in range(shards)]
        self.shards = [self.attach(r) for r in self.replicas]

    def open(self, shard: int) -> Replica:
        hyper = job_hyper(self.settings)

        def make() -> Replica:
            return Replica(
                shard, self.template, "block1", hyper.server_optimizer, torch.device("cpu")
            )

        replica = open_replica(self.store, self.job, make, LOG)
        assert replica is not None
        return replica

    def attach(self, replica: Replica) -> Continuous:
        return Continuous(replica, self.store, self.job, 2, self.stats, LOG)

    def server(self, version: int) -> dict[str, torch.Tensor]:
        return self.store.read_blob(self.job, version, SERVER)

    def train(self, shard: int, by: float, samples: int) -> None:
        """Stand-in for server steps: every parameter moves by `by`, `samples` rows applied."""
        replica = self.replicas[shard]
        with torch.no_grad():
            for p in replica.server.parameters():
                p.add_(by)
        replica.applied += 1
        replica.round_samples += samples

    def checkpoint(self, shard: int) -> Checkpoint:
        """What `ShardRunner.checkpoint` does in async mode."""
        mode = self.shards[shard]
        saved = mode.save()
        self.store.save_checkpoint(self.job, saved)
        mode.saved(saved)
        return saved

    def publish(self) -> int:
        """One async fold of the server side (the clients' part unchanged)."""
        version = self.store.current_version(self.job)
        current = read_version(self.store, self.job, version)
        replicas, taken = self.ledger.fresh(current[SERVER])
        blobs = dict(current)  # the client side is not under test here
        if replicas:
            blobs[SERVER] = weighted_average(
                [r.weights for r in replicas], [r.samples for r in replicas]
            )
        new = self.store.publish_version(self.job, version, blobs, meta=self.ledger.meta(taken))
        self.ledger.commit(taken)
        return new


def param_names(replica: Replica) -> list[str]:
    """The trained parameters the server blob holds (the replica has heads beyond it)."""
    blob = replica.checkpoint().weights
    return [n for n, _ in replica.server.named_parameters() if n in blob]


def assert_shifted(
    got: dict[str, torch.Tensor], base: dict[str, torch.Tensor], by: float, names: list[str]
) -> None:
    for name in names:
        assert_close(got[name], base[name] + by, msg=f"{name} not moved by {by}")


def test_one_shard_publishes_its_checkpoint_and_rebasing_changes_nothing(job: str) -> None:
    s = Setup(job, 1)
    g1 = s.server(1)
    names = param_names(s.replicas[0])
    s.train(0, 0.5, 64)
    first = s.checkpoint(0)
    assert first.meta["anchor_applied"] == -1 and first.meta["version"] == 1
    v2 = s.publish()
    assert_shifted(s.server(v2), g1, 0.5, names)
    assert folded_of(s.store.manifest(job, v2).meta)[0].applied == first.applied

    s.train(0, 0.25, 32)
    second = s.checkpoint(0)  # rebases onto v2 first: the replica is unchanged by it
    assert s.stats.rebases == 1
    assert second.meta == {**second.meta, "version": v2, "anchor_applied": first.applied}
    assert_shifted(dict(second.weights), g1, 0.75, names)
    v3 = s.publish()
    assert_shifted(s.server(v3), g1, 0.75, names)
    for name in names:  # the version's server blob is the replica itself
        assert_close(s.server(v3)[name], second.weights[name])


def test_two_shards_count_every_step_once(job: str) -> None:
    s = Setup(job, 2)
    g1 = s.server(1)
    names = param_names(s.replicas[0])
    s.train(0, 1.0, 100)
    s.train(1, 3.0, 300)
    s.checkpoint(0)
    s.checkpoint(1)
    v2 = s.publish()
    # Sample-weighted: (100 * 1 + 300 * 3) / 400.
    assert_shifted(s.server(v2), g1, 2.5, names)

    # Shard 0 rebases (at its next checkpoint) and trains +2; shard 1 trains +1 before it
    # rebases: its progress since the folded checkpoint survives the rebase.
    s.train(1, 1.0, 100)
    s.train(0, 2.0, 100)
    s.checkpoint(0)
    s.checkpoint(1)
    assert s.stats.rebases == 2
    for shard, moved in ((0, 2.0), (1, 1.0)):
        weights = dict(s.store.load_checkpoint(job, shard).weights)  # type: ignore[union-attr]
        assert_shifted(weights, s.server(v2), moved, names)
    v3 = s.publish()
    assert_shifted(s.server(v3), s.server(v2), (100 * 2.0 + 100 * 1.0) / 200, names)


def test_a_fold_of_an_older_checkpoint_still_rebases_exactly(job: str) -> None:
    """The aggregator read checkpoint A; the worker saved B before the version folding A was
    published. The replica rebases from A (kept in its ring), not from B."""
    s = Setup(job, 1)
    names = param_names(s.replicas[0])
    s.train(0, 1.0, 10)
    a = s.checkpoint(0)
    version = s.store.current_version(job)
    current = read_version(s.store, job, version)
    replicas, taken = s.ledger.fresh(current[SERVER])  # the aggregator reads A ...
    s.train(0, 2.0, 10)
    b = s.checkpoint(0)  # ... the worker saves B meanwhile (nothing newer to rebase onto)
    assert s.stats.rebases == 0 and b.applied > a.applied
    v2 = s.store.publish_version(
        job, version, {**current, SERVER: dict(replicas[0].weights)}, meta=s.ledger.meta(taken)
    )
    s.ledger.commit(taken)
    s.train(0, 4.0, 10)
    c = s.checkpoint(0)
    assert s.stats.rebases == 1 and c.meta["anchor_applied"] == a.applied
    # The server blob of v2 is A; the replica keeps B's and C's progress on top of it.
    assert_shifted(dict(c.weights), s.server(v2), 6.0, names)
    # The aggregator then folds exactly that progress.
    v3 = s.publish()
    assert_shifted(s.server(v3), s.server(v2), 6.0, names)


def test_the_ledger_waits_for_a_checkpoint_it_cannot_place(job: str) -> None:
    s = Setup(job, 1)
    s.train(0, 1.0, 10)
    s.checkpoint(0)
    v2 = s.publish()
    # A checkpoint anchored at v2 that claims it rebased from a fold the ledger never made.
    forged = Checkpoint(
        shard=0,
        applied=99,
        weights=s.server(v2),
        meta={"version": v2, "anchor_applied": 42, "round_samples": 500},
    )
    s.store.save_checkpoint(job, forged)
    replicas, taken = s.ledger.fresh(s.server(v2))
    assert replicas == [] and taken == {} and s.ledger.skipped == 1


def test_a_restarted_ledger_resumes_from_the_manifest(job: str) -> None:
    s = Setup(job, 1)
    names = param_names(s.replicas[0])
    s.train(0, 1.0, 10)
    s.checkpoint(0)
    v2 = s.publish()
    restarted = ServerLedger(s.store, job, 1, LOG)
    restarted.restore(s.store.manifest(job, v2).meta)
    assert restarted.folded[0] == FoldedCheckpoint(s.ledger.folded[0].applied, 1, 10, {}, None)
    s.ledger = restarted
    s.train(0, 2.0, 10)
    s.checkpoint(0)  # rebased onto v2: measured from v2's server blob, which it has
    v3 = s.publish()
    assert_shifted(s.server(v3), s.server(v2), 2.0, names)


def test_statistics_are_not_replayed_by_a_rebase(job: str) -> None:
    s = Setup(job, 2)
    s.train(0, 1.0, 10)
    replica = s.replicas[0]
    stats = {n: t.clone() for n, t in replica.server.state_dict().items() if is_statistic(n)}
    assert stats, "cnn5's server side has batch-norm statistics"
    s.checkpoint(0)
    s.train(1, 1.0, 10)
    s.checkpoint(1)
    s.publish()
    s.checkpoint(0)
    assert s.stats.rebases == 1
    for name, tensor in replica.server.state_dict().items():
        if name in stats:
            assert torch.equal(tensor, stats[name])


def test_smashed_data_too_old_for_the_bound_is_refused(job: str) -> None:
    s = Setup(job, 1)
    mode = s.shards[0]

    def batch(version: int) -> SmashedBatch:
        z = torch.zeros((2, *s.template.cut_shape("block1")))
        y = torch.zeros(2, dtype=torch.int64)
        return SmashedBatch(job, "c", new_message_id(), version, 1, 0, 0, 0, z, y)

    assert mode.refusal(batch(1)) is None
    unknown = mode.refusal(batch(6))  # never published: a forged version, dead-lettered
    assert unknown is not None and unknown.code == "unknown_version"
    while s.publish() < 6:
        pass
    assert mode.refusal(batch(6)) is None  # a client on version 6: the worker learns of it
    assert mode.refusal(batch(4)) is None  # 2 behind: at the bound
    refused = mode.refusal(batch(3))
    assert refused is not None and refused.code == TOO_STALE
    reason = refused.detail
    assert reason.startswith(f"{TOO_STALE}: ")
    assert "version 3" in reason and "3 versions behind 6" in reason


def test_fold_and_ledger_agree_with_the_strategy(job: str) -> None:
    """The driver's path: `fold` with the ledger's replicas through SFL's own aggregate."""
    s = Setup(job, 1)
    s.train(0, 1.0, 10)
    s.checkpoint(0)
    current = read_version(s.store, job, 1)
    replicas, _ = s.ledger.fresh(current[SERVER])
    update = StaleUpdate(
        ClientUpdate("c", 5, 1, current[CLIENT]), 0, current[CLIENT], {}, current[CLIENT], {}
    )
    folded = fold(s.strategy, current, [update], StalenessRule(), replicas)
    assert set(folded[SERVER]) == set(current[SERVER])
    for name, tensor in s.replicas[0].checkpoint().weights.items():
        assert_close(folded[SERVER][name], tensor)
