"""FedSplitX exactness: the real roles train the very weights a hand-written loop does.

Two clients at levels 1 and 2 (cnn5 cut after block1 and after block2), each on its own shard
so each replica sees one client's batches in order (one replica's order across clients would
depend on timing). The reference below writes the whole algorithm out with plain torch: the
client's summed head losses, the server's loss from the batch's own cut over the deeper heads
and the output, and heteroavg by hand: client 0 holds block 0 and a_1; client 1 blocks 0-1
and a_1, a_2; replica 0 (level-1 batches) blocks 1-3, a_2 and a_3; replica 1 blocks 2-3 and
a_3. So block 1 and a_2 average a client with a replica, blocks 2-3 and a_3 two replicas.
A wrong cut, head, holder or weight moves the weights by far more than the tolerance.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch.nn import functional as F

from broker.store import AUX_PART, CLIENT_PART, SERVER_PART, BlobRef
from services.client.data import JobData
from services.common.backends import Backends, Embedded
from services.common.jobmodel import job_model
from services.config.root import Settings
from services.data.loaders import Dataset
from tests.integration.reference_loops import round_batches
from tests.integration.test_exactness import (
    ROUNDS,
    TOLERANCE,
    cleanup,
    connections,
    dataset,
    job_settings,
    train,
)
from tests.unit.test_client_peers import max_diff
from tests.unit.test_worker_support import one_torch_thread

__all__ = ["cleanup", "connections", "dataset", "one_torch_thread"]  # fixtures used here

pytestmark = pytest.mark.slow

CUTS = ("block1", "block2", "block3")
LEVELS = {0: 1, 1: 2}  # partition -> level, as clients.capability_mix = "1,1" deals them

Tensors = dict[str, torch.Tensor]


def reference(settings: Settings, dataset: Dataset, rounds: int) -> Tensors:
    """The whole model after `rounds` rounds, written out by hand."""
    a = settings.algorithm
    data = JobData(settings, dataset)
    initial = job_model(settings, seed=settings.job.seed)
    names = initial.block_names
    global_state = {k: v.detach().clone() for k, v in initial.state_dict().items()}
    for r in range(rounds):
        holders: list[tuple[Tensors, float]] = []
        for partition, level in LEVELS.items():
            cut = CUTS[level - 1]
            last = names.index(cut)
            client, server = copy.deepcopy(initial), copy.deepcopy(initial)
            client.load_state_dict(global_state)
            server.load_state_dict(global_state)
            client.train()
            server.train()
            own = CUTS[:level]
            client_params = [
                p
                for n, p in client.named_parameters()
                if (n.startswith("blocks.") and int(n.split(".")[1]) <= last)
                or (n.startswith("heads.") and n.split(".")[1] in own)
            ]
            # The replica: everything after the shallowest cut, heads of the later cuts.
            server_params = [
                p
                for n, p in server.named_parameters()
                if (n.startswith("blocks.") and int(n.split(".")[1]) > 0)
                or (n.startswith("heads.") and n.split(".")[1] in CUTS[1:])
            ]
            client_opt = torch.optim.SGD(client_params, lr=a.lr, momentum=a.momentum)
            server_opt = torch.optim.SGD(
                server_params, lr=a.effective_server_lr, momentum=a.momentum
            )
            rows = 0
            for x, y in round_batches(settings, data, partition, r):
                h, client_losses = x, []
                for i in range(last + 1):
                    h = client.blocks[i](h)
                    if names[i] in own:
                        client_losses.append(F.cross_entropy(client.heads[names[i]](h), y))
                s, server_losses = h.detach(), []
                for i in range(last + 1, len(names)):
                    s = server.blocks[i](s)
                    if names[i] in CUTS:
                        server_losses.append(F.cross_entropy(server.heads[names[i]](s), y))
                server_losses.append(F.cross_entropy(s, y))
                server_opt.zero_grad()
                torch.stack(server_losses).sum().backward()
                server_opt.step()
                client_opt.zero_grad()
                torch.stack(client_losses).sum().backward()
                client_opt.step()
                rows += int(y.shape[0])
            held_by_client = {
                n: v
                for n, v in client.state_dict().items()
                if (n.startswith("blocks.") and int(n.split(".")[1]) <= last)
                or (n.startswith("heads.") and n.split(".")[1] in own)
            }
            # The replica trained the blocks after this client's cut and the heads after it.
            held_by_replica = {
                n: v
                for n, v in server.state_dict().items()
                if (n.startswith("blocks.") and int(n.split(".")[1]) > last)
                or (n.startswith("heads.") and n.split(".")[1] in CUTS[level:])
            }
            holders += [(held_by_client, float(rows)), (held_by_replica, float(rows))]
        for name, old in global_state.items():
            held = [(s[name], w) for s, w in holders if name in s]
            if not held:
                continue
            if old.is_floating_point():
                total = sum(w for _, w in held)
                acc = sum(w * v.double() for v, w in held)
                assert isinstance(acc, torch.Tensor)
                global_state[name] = (acc / total).to(old.dtype)
            else:
                global_state[name] = torch.stack([v for v, _ in held]).amax(dim=0)
    return global_state


def test_two_levels_on_two_shards_match_the_hand_written_loop(
    job: str,
    connections: dict[str, dict[str, Any]],
    dataset: Dataset,
    cleanup: list[tuple[Backends, Settings]],
) -> None:
    base = job_settings(job, connections, algorithm="fedsplitx", clients=2)
    settings = base.model_copy(
        update={
            "algorithm": base.algorithm.model_copy(update={"shards": 2}),
            "clients": base.clients.model_copy(update={"capability_mix": "1,1"}),
        }
    )
    assert settings.shards == 2
    backends = Backends(settings.broker, settings.store, Embedded())
    cleanup.append((backends, settings))

    trained = train(settings, backends, dataset)
    store = backends.open_store()
    try:
        final = store.current_version(job)
        aux = store.read_blob(job, final, BlobRef(AUX_PART))
        blobs = {
            part: store.read_blob(job, final, BlobRef(part)) for part in (CLIENT_PART, SERVER_PART)
        }
    finally:
        store.close()
    want = reference(settings, dataset, ROUNDS)

    steps = ROUNDS * settings.algorithm.max_steps_per_round
    assert trained.worker.batches_applied == 2 * steps, trained.worker
    assert trained.worker.dead_lettered_total == 0 and trained.worker.rollbacks == 0
    for s in trained.clients:
        assert s.finished and s.rounds == ROUNDS and s.rounds_aborted == 0, s
    assert set(aux) == {n for n in want if n.startswith("heads.")}
    for what, got in (("aux", aux), *blobs.items()):
        diff = max_diff(got, {n: want[n] for n in got})
        assert diff <= TOLERANCE, f"{what}/global differs from the reference by {diff}"
    # Every tensor moved: each one had a holder in each round.
    initial = job_model(settings, seed=settings.job.seed).state_dict()
    merged = {**aux, **blobs[CLIENT_PART], **blobs[SERVER_PART]}
    unmoved = [n for n, v in merged.items() if v.is_floating_point() and torch.equal(v, initial[n])]
    assert not unmoved, unmoved
