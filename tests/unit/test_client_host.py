"""The client host (services/client/host.py): many clients in one process on shared
connections, over the in-memory broker and store with the real service roles."""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from broker.codec import encode
from broker.messages import Error, new_message_id
from broker.store import CLIENT_PART, GLOBAL_OWNER, BlobRef
from broker.topology import (
    REPLIES_EXCHANGE,
    dead_queue_name,
    host_queue,
    host_queue_name,
    reply_routing_key,
)
from broker.transport import REASON_HEADER, PublishOptions
from services.client.client import Client
from services.client.data import JobData
from services.client.host import ClientHost, hosted_client_id
from services.client.host_stats import HostStats
from services.client.hostlink import Dispatcher
from services.client.lending import ModelPool, SpilledMemory
from services.client.stats import ClientStats
from services.common.backends import Backends, Embedded
from services.common.jobmodel import job_model
from services.common.supervise import Role, RoleSpec, Supervisor
from services.config.root import Settings
from services.data.loaders import Dataset, load_dataset
from services.report.records import ListSink
from services.runtime.roles import build_aggregator, build_coordinator, build_worker

JOB = "hosted"


@pytest.fixture(scope="module")
def dataset() -> Dataset:
    return load_dataset("fashion_mnist_sample", env={})


def settings(
    algorithm: str, clients: int, *, rounds: int = 2, fraction: float = 1.0, ttl_s: float = 10.0
) -> Settings:
    return Settings.model_validate(
        {
            "job": {"name": JOB, "rounds": rounds, "seed": 3},
            "data": {"dataset": "fashion_mnist_sample", "eval_samples": 200},
            "algorithm": {"name": algorithm, "batch_size": 32, "max_steps_per_round": 2},
            "clients": {
                "count": clients,
                "fraction": fraction,
                "min_to_start": clients,
                "heartbeat_s": 0.5,
                "heartbeat_ttl_s": ttl_s,
            },
            "workers": {"count": 2},
            "rounds": {"deadline_s": 30.0},
        }
    )


def service_roles(s: Settings, backends: Backends, data: Dataset, sink: ListSink) -> list[RoleSpec]:
    roles = [
        RoleSpec(
            "aggregator", "aggregator", build_aggregator(s, backends, sink=sink, dataset=data)
        ),
        RoleSpec("coordinator", "coordinator", build_coordinator(s, backends)),
    ]
    if s.algorithm.name != "fedavg":
        roles += [
            RoleSpec(f"worker-{i}", "worker", build_worker(s, backends, worker_id=f"worker-{i}"))
            for i in range(s.workers.count)
        ]
    return roles


def run_job(s: Settings, backends: Backends, roles: Sequence[RoleSpec]) -> str:
    return Supervisor(list(roles), threading.Event()).run().status


def final_client_weights(s: Settings, backends: Backends) -> dict[str, torch.Tensor]:
    store = backends.open_store()
    version = store.current_version(JOB)
    return store.read_blob(JOB, version, BlobRef(CLIENT_PART, GLOBAL_OWNER))


class Recorded:
    """A host whose stats the test reads after the run."""

    def __init__(self, host: ClientHost) -> None:
        self.host = host
        self.stats: HostStats | None = None

    def run(self, stop: threading.Event) -> HostStats:
        self.stats = self.host.run(stop)
        return self.stats


def hosted(role: Recorded) -> RoleSpec:
    r: Role = role
    return RoleSpec("host", "client", r)


def test_a_host_runs_a_sharded_job_to_its_end(dataset: Dataset) -> None:
    s = settings("sfl", 12, fraction=0.5)
    backends = Backends(s.broker, s.store, Embedded())
    sink = ListSink()
    host = Recorded(ClientHost(s, backends, host="edge", count=12, dataset=dataset))
    status = run_job(s, backends, [*service_roles(s, backends, dataset, sink), hosted(host)])
    assert status == "finished"
    stats = host.stats
    assert stats is not None and stats.finished and stats.job_status == "finished"
    assert set(stats.per_client) == {hosted_client_id("edge", i) for i in range(12)}
    assert all(c.joins_sent >= 1 for c in stats.per_client.values())
    total = stats.total()
    assert total.rounds == 2 * 6  # 2 rounds of half the clients, each uploaded once
    assert total.batches_sent == total.replies_received > 0
    # Models are lent to the clients training at once, not kept per client.
    assert stats.models_built <= 6 + 1
    assert stats.dispatch.dead_lettered == 0
    assert stats.beat_messages >= 1 and stats.beat_members >= 12
    assert len(sink.records) == 2
    # The job is over: the host took its queue down (the hub knows no such queue any more).
    assert backends.embedded is not None
    assert host_queue_name(JOB, "edge") not in backends.embedded.hub.queues


def test_a_host_trains_exactly_as_standalone_clients(dataset: Dataset) -> None:
    """FedAvg rounds are deterministic: the same clients (ids, partitions) give the same
    model whether each runs standalone or all run on one host."""
    n = 4
    finals = []
    for on_host in (False, True):
        s = settings("fedavg", n)
        backends = Backends(s.broker, s.store, Embedded())
        roles = service_roles(s, backends, dataset, ListSink())
        shared = JobData(s, dataset)
        if on_host:
            roles.append(
                hosted(Recorded(ClientHost(s, backends, host="edge", count=n, dataset=shared)))
            )
        else:
            roles += [
                RoleSpec(
                    f"client-{i}",
                    "client",
                    Client(s, backends, client_id=f"edge-{i}", partition=i, dataset=shared),
                )
                for i in range(n)
            ]
        assert run_job(s, backends, roles) == "finished"
        finals.append(final_client_weights(s, backends))
    alone, together = finals
    assert alone.keys() == together.keys()
    for name, tensor in alone.items():
        assert torch.equal(tensor, together[name]), name


def test_standalone_clients_train_beside_a_host(dataset: Dataset) -> None:
    s = settings("sfl", 5)
    backends = Backends(s.broker, s.store, Embedded())
    shared = JobData(s, dataset)
    host = Recorded(ClientHost(s, backends, host="edge", count=4, dataset=shared))
    alone = Client(s, backends, client_id="solo", partition=4, dataset=shared)
    solo: list[ClientStats] = []

    class Kept:
        def run(self, stop: threading.Event) -> ClientStats:
            solo.append(alone.run(stop))
            return solo[0]

    roles = [*service_roles(s, backends, dataset, ListSink()), hosted(host)]
    roles.append(RoleSpec("solo", "client", Kept()))
    assert run_job(s, backends, roles) == "finished"
    assert host.stats is not None and host.stats.total().rounds == 2 * 4
    assert solo[0].rounds == 2 and solo[0].finished


@pytest.mark.parametrize("back_at", [3.5, 2.51])
def test_clients_go_offline_mid_job_and_come_back(dataset: Dataset, back_at: float) -> None:
    """Client 1 vanishes (most likely in a round: the job cannot start without it) and comes
    back: its new session joins as a new process and trains, and the job ends. At 2.51 s it
    is back before its old session has stopped: the new one starts once the old has ended."""
    s = settings("sfl", 4, rounds=30, ttl_s=1.0)
    s = s.model_copy(
        update={"algorithm": s.algorithm.model_copy(update={"max_steps_per_round": 1})}
    )

    def online(index: int, client: str) -> Sequence[tuple[float, float]]:
        if index == 1:
            return ((0.0, 2.5), (back_at, math.inf))
        return ((0.0, math.inf),)

    backends = Backends(s.broker, s.store, Embedded())
    host = Recorded(ClientHost(s, backends, host="edge", count=4, dataset=dataset, online=online))
    status = run_job(s, backends, [*service_roles(s, backends, dataset, ListSink()), hosted(host)])
    assert status == "finished"
    assert host.stats is not None
    sessions = [one for client, one in host.stats.per_session if client == "edge-1"]
    assert len(sessions) == 2
    assert sessions[0].finished is False  # stopped by going offline
    back = sessions[1]
    assert back.joins_sent >= 1 and back.join_s > 0 and back.rounds >= 1 and back.finished
    assert host.stats.dispatch.dead_lettered == 0


def test_the_dispatcher_routes_drops_and_dead_letters(tmp_path: Path) -> None:
    s = settings("sfl", 2)
    backends = Backends(s.broker, s.store, Embedded())
    admin = backends.open_broker("admin")
    admin.declare(s.job_queues())
    for client in ("edge-0", "edge-1", "stranger"):
        admin.declare([host_queue(JOB, "edge", client)])
    inbound = backends.open_broker("host")
    dispatcher = Dispatcher(
        inbound,
        host_queue(JOB, "edge"),
        owns=lambda c: c.startswith("edge-"),
        prefetch=16,
        logger=logging.getLogger("test"),
    )
    dispatcher.open()
    inbox = dispatcher.attach("edge-0")

    def reply(client: str, body: bytes | None = None) -> None:
        message = Error(JOB, client, new_message_id(), 1, "round_closed", "late")
        admin.publish(
            REPLIES_EXCHANGE,
            reply_routing_key(JOB, client),
            body if body is not None else encode(message),
            PublishOptions(new_message_id()),
        )

    reply("edge-0")
    reply("edge-1")  # one of the host's clients, offline: dropped
    reply("stranger")  # bound to this queue, yet not the host's: dead-lettered
    reply("edge-0", b"SMQ\x01garbage")
    stop = threading.Event()
    thread = threading.Thread(target=dispatcher.run, args=(stop,))
    thread.start()
    try:
        got = inbox.get(5.0)
        assert got is not None
        dispatcher.settle(got, None)
        for _ in range(100):
            if dispatcher.stats.dead_lettered == 2 and dispatcher.stats.offline_dropped == 1:
                break
            stop.wait(0.05)
    finally:
        stop.set()
        thread.join(5.0)
    assert (dispatcher.stats.routed, dispatcher.stats.offline_dropped) == (1, 1)
    assert dispatcher.stats.dead_lettered == 2
    admin.subscribe(dead_queue_name(JOB), prefetch=8)
    reasons = []
    while (letter := admin.get(0.2)) is not None:
        reasons.append(str(letter.headers.get(REASON_HEADER)))
        admin.ack(letter)
    assert any(r.startswith("undecodable") for r in reasons), reasons
    assert any("not one of this host's" in r for r in reasons), reasons


def test_the_model_pool_lends_a_model_per_concurrent_round(dataset: Dataset) -> None:
    s = settings("sfl", 2)
    pool = ModelPool(lambda: job_model(s))
    with pool.borrow() as a, pool.borrow() as b:
        assert a is not b and a is not pool.reference and b is not pool.reference
    with pool.borrow() as c:
        assert c in (a, b)
    assert pool.built == 2


def test_spilled_memory_keeps_an_idle_clients_tensors_on_disk(tmp_path: Path) -> None:
    memory = SpilledMemory(tmp_path / "spill" / "edge-3.safetensors")
    assert memory.take() == ("", {})
    mask = torch.tensor([True, False, True])
    weights = torch.arange(6.0).reshape(2, 3)
    memory.put("subfedavg", {"mask.a": mask, "w": weights, "view": weights[0]})
    assert (tmp_path / "spill" / "edge-3.safetensors").exists()
    algorithm, tensors = memory.take()
    assert algorithm == "subfedavg"
    assert torch.equal(tensors["mask.a"], mask) and torch.equal(tensors["w"], weights)
    assert torch.equal(tensors["view"], weights[0])
    memory.put("subfedavg", {})
    assert not (tmp_path / "spill" / "edge-3.safetensors").exists()


def test_spilled_memory_trains_exactly_as_memory_kept_in_ram(
    dataset: Dataset, tmp_path: Path
) -> None:
    """Sub-FedAvg keeps each client's masks between its rounds: with `spill_dir` they wait on
    disk, and the job's weights come out bit-identical to a host that keeps them in RAM."""
    n = 3
    finals = []
    for spill in (None, tmp_path / "spill"):
        base = settings("subfedavg", n, rounds=3).model_dump()
        # Masks adopted from the first round on: pruning needs no accuracy to be reached.
        pruning = {"acc_thresh": 0.0, "prune_percent": 0.2}
        base["algorithm"].update(max_steps_per_round=4, subfedavg=pruning)
        s = Settings.model_validate(base)
        backends = Backends(s.broker, s.store, Embedded())
        host = ClientHost(s, backends, host="edge", count=n, dataset=dataset, spill_dir=spill)
        roles = [*service_roles(s, backends, dataset, ListSink()), hosted(Recorded(host))]
        assert run_job(s, backends, roles) == "finished"
        finals.append(final_client_weights(s, backends))
    spilled = sorted(p.name for p in (tmp_path / "spill").iterdir())
    assert spilled == [f"edge-{i}.safetensors" for i in range(n)]  # every client's masks, on disk
    kept, on_disk = finals
    assert kept.keys() == on_disk.keys()
    for name, tensor in kept.items():
        assert torch.equal(tensor, on_disk[name]), name
