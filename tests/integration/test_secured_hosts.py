"""Client hosts in the secured mode against the real RabbitMQ (docs/deployment.md, "Security").

`splitmq provision-clients --hosts edge,core` creates the host users `<job>.host.edge` and
`<job>.host.core`, their env files and their host queues, each named `<job>.host.<H>.<hidden>`
after its host's password (services/security/hidden.py). Then:

- edge can consume its own host queue, but not core's nor a client's reply queue
  (ACCESS_REFUSED), and cannot declare (so cannot bind) anything; its passive declare of
  core's queue under the guessable name `<job>.host.core` finds nothing (NOT_FOUND);
- with the coordinator running in the secured mode, edge's Join for its client edge-0 is
  welcomed on edge's queue (the coordinator bound edge-0's key), and its HostHeartbeat renews
  edge-0; a Join and a HostHeartbeat from edge claiming core's client core-0 are dead-lettered
  with the reason, and nothing was bound for core-0 (its replies are unroutable); a Join of
  edge's own client naming a host queue that is not edge's, or of edge's shape but missing, is
  dead-lettered with the reason (and the coordinator creates no queue).

The users are revoked at the end (`--revoke --hosts`), and with them their host queues.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from dataclasses import replace
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from broker.codec import decode, encode
from broker.errors import BrokerError, UnroutableError
from broker.messages import HostHeartbeat, Join, Message, Welcome, new_message_id
from broker.rabbitmq import RabbitMQBroker, RabbitMQOptions
from broker.topology import (
    CONTROL_EXCHANGE,
    REPLIES_EXCHANGE,
    host_queue,
    host_queue_name,
    reply_queue,
    reply_queue_name,
    reply_routing_key,
)
from broker.transport import PublishOptions, QueueSpec
from services.aggregator.aggregator import ensure_initial_version
from services.algorithms.registry import build_strategy
from services.cli.main import cli
from services.client.host import ClientHost
from services.common.backends import Backends
from services.common.supervise import RoleSpec, Supervisor
from services.config.loading import load_settings
from services.coordinator.coordinator import Coordinator
from services.coordinator.welcomes import REWELCOME_S
from services.data.loaders import load_dataset
from services.report.records import ListSink
from services.runtime.roles import build_aggregator, build_coordinator, build_worker
from services.security.hidden import host_reply_queue, queue_secret
from services.security.identity import amqp_user, host_user
from tests.integration.test_secured_mode import (
    CONFIG,
    admin_or_skip,
    client_handle,
    dead_letters,
    surviving_queues,
)
from tests.unit.test_aggregator_peers import WAIT_S, declare_all, delete_all, running

pytestmark = [pytest.mark.rabbitmq, pytest.mark.redis]

HOSTS = ("edge", "core")


def provision_hosts(config: Path, out: Path, *extra: str) -> Result:
    args = ["provision-clients", str(config), "--hosts", ",".join(HOSTS), "--out", str(out)]
    return CliRunner().invoke(cli, [*args, *extra], catch_exceptions=False)


def host_env(out: Path, job: str, host: str) -> dict[str, str]:
    lines = (out / f"{host_user(job, host)}.env").read_text().splitlines()
    return dict(line.split("=", 1) for line in lines if "=" in line)


def host_spec(out: Path, job: str, host: str) -> QueueSpec:
    """Host `host`'s queue as provisioning declared it, named after its password."""
    return host_reply_queue(
        job, host, queue_secret(True, host_env(out, job, host)["SPLITMQ_AMQP_URL"])
    )


def send(handle: RabbitMQBroker, user: str, message: Message, marker: str) -> None:
    options = PublishOptions(message_id=marker, user_id=user)
    handle.publish(CONTROL_EXCHANGE, message.job, encode(message), options)


def test_a_host_user_reads_its_own_clients_replies_only(
    amqp_url: str, redis_url: str, tmp_path: Path
) -> None:
    admin_or_skip(amqp_url)
    job = f"t{uuid.uuid4().hex[:12]}"
    config = tmp_path / "job.toml"
    text = CONFIG.format(amqp_url=amqp_url, redis_url=redis_url, job=job, algorithm="sfl_v2")
    config.write_text(text)
    settings = load_settings(config, {})
    backends = Backends(settings.broker, settings.store)
    declare_all(backends, settings, [])
    out = tmp_path / "secrets"
    services = backends.open_broker("test-services")
    store = backends.open_store()
    edge: RabbitMQBroker | None = None
    try:
        done = provision_hosts(config, out)
        assert done.exit_code == 0, done.output
        assert f"edge (user {host_user(job, 'edge')})" in done.output
        services.declare([reply_queue(job, "solo")])  # a standalone client's queue
        edge = client_handle(host_env(out, job, "edge"), "test-host-edge")
        user = host_user(job, "edge")

        # Confinement: its own queue yes; core's, a client's, and any declaring: no.
        spec, core = host_spec(out, job, "edge"), host_spec(out, job, "core")
        assert spec.name.startswith(f"{host_queue_name(job, 'edge')}.")
        edge.declare([spec])  # passive: provisioning declared it
        edge.subscribe(spec.name, prefetch=10)
        for queue in (core.name, reply_queue_name(job, "solo")):
            with pytest.raises(BrokerError, match="ACCESS_REFUSED"):
                edge.subscribe(queue, prefetch=10)
        # Core's queue under its guessable name: nothing there (a passive declare needs no
        # permission, so a queue of that name would show its depth to edge).
        with pytest.raises(BrokerError, match="NOT_FOUND"):
            edge.queue_depth(host_queue_name(job, "core"))
        binding = RabbitMQBroker(
            host_env(out, job, "edge")["SPLITMQ_AMQP_URL"], RabbitMQOptions(give_up_after=10)
        )
        try:
            with pytest.raises(BrokerError, match="ACCESS_REFUSED"):
                binding.declare([host_queue(job, "edge", "core-0")])  # a bind needs configure
        finally:
            binding.close()

        strategy = build_strategy(settings.algorithm.name, settings.algorithm.params())
        ensure_initial_version(store, settings, strategy, logging.getLogger("test"))
        coordinator = Coordinator(settings, backends, poll_s=0.05)
        with running([coordinator.run]):
            steal = Join(job, "core-0", new_message_id(), 0, 10, 0, {"host": "core"})
            send(edge, user, steal, "steal-join")
            beat = HostHeartbeat(job, "core", new_message_id(), 1, {"core-0": 1})
            send(edge, user, beat, "steal-beat")
            info = {"host": "edge", "host_queue": spec.name}
            for name in (core.name, host_queue_name(job, "core"), f"{spec.name[:-1]}X"):
                odd = Join(job, "edge-1", new_message_id(), 0, 10, 0, {**info, "host_queue": name})
                send(edge, user, odd, f"odd-{name}")
            # Of edge's shape but no queue: the coordinator creates none (its channel survives
            # the NOT_FOUND: the Join below is still answered).
            missing = host_queue_name(job, "edge", "0" * 32)
            odd = Join(job, "edge-1", new_message_id(), 0, 10, 0, {**info, "host_queue": missing})
            send(edge, user, odd, "missing")
            own = Join(job, "edge-0", new_message_id(), 0, 10, 0, info)
            send(edge, user, own, "own-join")
            delivery = edge.get(WAIT_S)
            assert delivery is not None, "no Welcome for edge-0 on edge's queue"
            edge.ack(delivery)
            welcome = decode(delivery.body)
            send(edge, user, HostHeartbeat(job, "edge", new_message_id(), 1, {"edge-0": 1}), "b")
            # After the heartbeat: one queue, in order. A Join of its own (a replay would be
            # dead-lettered), past the coordinator's interval between two Welcomes.
            time.sleep(REWELCOME_S)
            send(edge, user, replace(own, message_id=new_message_id()), "own-join-again")
            again = edge.get(WAIT_S)
            assert again is not None
            edge.ack(again)

        assert isinstance(welcome, Welcome) and welcome.client == "edge-0"
        found = dead_letters(services, job)
        assert found["steal-join"] == (
            f"client 'core-0' does not match the AMQP user {user!r}",
            user,
        )
        assert found["steal-beat"] == (f"host 'core' does not match the AMQP user {user!r}", user)
        for name in (core.name, host_queue_name(job, "core"), f"{spec.name[:-1]}X"):
            reason = (
                f"Join of client 'edge-1' names host queue {name!r}: host 'edge''s queue is "
                f"{host_queue_name(job, 'edge')!r}, or that name, '.' and 32 lowercase hex digits"
            )
            assert found[f"odd-{name}"] == (reason, user)
        assert found["missing"] == (
            f"cannot bind client 'edge-1''s replies to host 'edge': its queue {missing!r} "
            "does not exist",
            user,
        )
        assert len(found) == 6, found
        stats = coordinator.stats
        assert (stats.joined, stats.rejoined, stats.host_members) == (1, 1, 1)
        # Nothing routes core-0's replies anywhere: no binding was made for it.
        with pytest.raises(UnroutableError):
            services.publish(REPLIES_EXCHANGE, reply_routing_key(job, "core-0"), b"x")
        assert services.queue_depth(core.name) == 0
        with pytest.raises(UnroutableError):  # nor edge-1's
            services.publish(REPLIES_EXCHANGE, reply_routing_key(job, "edge-1"), b"x")
    finally:
        if edge is not None:
            edge.close()
        named = [host_spec(out, job, h).name for h in HOSTS]
        revoked = provision_hosts(config, out, "--revoke")
        guessed = [host_queue_name(job, h) for h in HOSTS] + [
            host_queue_name(job, "edge", "0" * 32)
        ]
        left = surviving_queues(backends, [*named, *guessed])
        delete_all(backends, settings, ["solo"])
        services.close()
        store.close()
        assert revoked.exit_code == 0, revoked.output
        assert left == [], left  # `--revoke` deleted the host queues


def test_a_secured_host_trains_a_job_as_its_own_user(
    amqp_url: str, redis_url: str, tmp_path: Path
) -> None:
    """End to end: the services in the secured mode, and a client host of three clients that
    logs in as the host user `provision-clients --hosts` made (confined: passive declares,
    its user stamped on every publish); the job trains to its end."""
    admin_or_skip(amqp_url)
    job = f"t{uuid.uuid4().hex[:12]}"
    config = tmp_path / "job.toml"
    text = CONFIG.format(amqp_url=amqp_url, redis_url=redis_url, job=job, algorithm="sfl_v2")
    config.write_text(text.replace("count = 2\nmin_to_start = 2", "count = 3\nmin_to_start = 3"))
    services = load_settings(config, {})
    services = services.model_copy(
        update={
            "job": services.job.model_copy(update={"rounds": 2}),
            "algorithm": services.algorithm.model_copy(update={"max_steps_per_round": 2}),
        }
    )
    backends = Backends(services.broker, services.store)
    declare_all(backends, services, [])
    out = tmp_path / "secrets"
    try:
        done = provision_hosts(config, out)
        assert done.exit_code == 0, done.output
        env = {k: v for k, v in host_env(out, job, "edge").items() if k.startswith("SPLITMQ_")}
        hosted = load_settings(config, env).model_copy(
            update={"job": services.job, "algorithm": services.algorithm}
        )
        assert amqp_user(hosted.broker.amqp_url) == host_user(job, "edge")
        data = load_dataset("fashion_mnist_sample", env={})
        host = ClientHost(
            hosted, Backends(hosted.broker, hosted.store), host="edge", count=3, dataset=data
        )
        sink = ListSink()
        roles = [
            RoleSpec("aggregator", "aggregator", build_aggregator(services, backends, sink=sink)),
            RoleSpec("coordinator", "coordinator", build_coordinator(services, backends)),
            RoleSpec("worker", "worker", build_worker(services, backends, worker_id="w0")),
            RoleSpec("host", "client", host),
        ]
        outcome = Supervisor(roles, threading.Event()).run()
        assert outcome.status == "finished"
        assert len(sink.records) == 2 and all(r.participants == 3 for r in sink.records)
        # Its replies came through its hidden queue; under the guessable name another user
        # (core) learns nothing.
        core = client_handle(host_env(out, job, "core"), "test-host-core")
        try:
            assert core.queue_depth(host_spec(out, job, "edge").name) == 0
            with pytest.raises(BrokerError, match="NOT_FOUND"):
                core.queue_depth(host_queue_name(job, "edge"))
        finally:
            core.close()
    finally:
        revoked = provision_hosts(config, out, "--revoke")
        delete_all(backends, services, [])
        assert revoked.exit_code == 0, revoked.output
