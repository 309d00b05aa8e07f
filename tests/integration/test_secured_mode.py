"""The secured mode against the real RabbitMQ: one user per client (design §3).

`splitmq provision-clients` creates two client users, `<job>.<id>` (with the management API if
the plugin answers, else `rabbitmqctl` on this host) and their env files. Then, with the
coordinator running with `security.per_client_users = true`:

- client A can consume its own reply queue, but not B's (ACCESS_REFUSED), cannot declare
  anything, and cannot publish to the replies exchange (it could forge a gradient there);
- a Join published by A that claims to be B is dead-lettered with the reason, and so is one
  without a user_id; A's own Join, stamped with its user, is welcomed.
- split inference (SplitGP): A's InferRequests are answered on its own inference reply queue;
  one A sends claiming to be B is dead-lettered with the reason; A may not consume B's
  inference replies, nor the infer queue itself.
- A may not publish to `splitmq.dead` (forged dead letters), yet a bad reply its handle
  dead-letters still reaches `<job>.dead` (rejected, routed by the reply queue's own
  dead-letter exchange).
- two jobs provisioned with the same `--prefix` get users of their own: both clients log in and
  read their queues, and revoking one job leaves the other's user working; provisioning a job's
  existing users again is refused unless `--force`.
- A cannot find B's queues: under their default names there are none (NOT_FOUND), and their
  real names hold a part only B's password gives.

The users are deleted again at the end (`--revoke`), and with them their reply queues.
"""

from __future__ import annotations

import copy
import logging
import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner, Result
from torch.testing import assert_close

from broker.codec import decode, encode
from broker.errors import BrokerError
from broker.messages import InferRequest, Join, Welcome, new_message_id
from broker.rabbitmq import RabbitMQBroker, RabbitMQOptions
from broker.store import SERVER_PART, BlobRef
from broker.topology import (
    CONTROL_EXCHANGE,
    DEAD_EXCHANGE,
    REPLIES_EXCHANGE,
    SMASHED_EXCHANGE,
    client_queue_names,
    control_queue_name,
    dead_queue_name,
    infer_queue_name,
    infer_routing_key,
    job_queues,
    reply_routing_key,
    shard_queue_name,
    shard_routing_key,
    updates_routing_key,
)
from broker.transport import REASON_HEADER, USER_HEADER, Broker, PublishOptions
from models.parts import ServerModel
from models.state import load_partial
from services.aggregator.aggregator import ensure_initial_version
from services.algorithms.registry import build_strategy
from services.cli.main import cli
from services.client.inference import BrokerTheta
from services.client.secured import client_theta, secured_client_broker
from services.common.backends import Backends
from services.common.jobmodel import job_model
from services.config.loading import load_settings
from services.config.root import Settings
from services.coordinator.coordinator import Coordinator
from services.security.admin import AdminError, pick_admin
from services.security.hidden import client_hidden, client_reply_queue, queue_secret
from services.security.identity import amqp_user, client_user
from tests.unit.test_aggregator_peers import WAIT_S, declare_all, delete_all, running
from workers.inference import InferenceServer

pytestmark = [pytest.mark.rabbitmq, pytest.mark.redis]

CONFIG = """
[broker]
kind = "rabbitmq"
amqp_url = "{amqp_url}"
[store]
kind = "redis"
redis_url = "{redis_url}"
[security]
per_client_users = true
[job]
name = "{job}"
[algorithm]
name = "{algorithm}"
[clients]
count = 2
min_to_start = 2
"""


def admin_or_skip(amqp_url: str) -> None:
    try:
        pick_admin("auto", amqp_url)
    except AdminError as exc:
        if os.environ.get("CI", "").lower() in {"1", "true", "yes"}:
            pytest.fail(f"cannot manage RabbitMQ users (CI=true): {exc}")
        pytest.skip(f"cannot manage RabbitMQ users here: {exc}")


Provisioned = tuple[Settings, dict[str, dict[str, str]], Path]


def provision(
    algorithm: str, amqp_url: str, redis_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Provisioned]:
    """A job of `algorithm` with two client users: the services' settings, per client user
    the variables of its env file, and the job's config file; revoked at the end."""
    admin_or_skip(amqp_url)
    job = f"t{uuid.uuid4().hex[:12]}"
    tmp_path = tmp_path_factory.mktemp("secured")
    config = tmp_path / "job.toml"
    text = CONFIG.format(amqp_url=amqp_url, redis_url=redis_url, job=job, algorithm=algorithm)
    config.write_text(text)
    settings = load_settings(config, {})
    backends = Backends(settings.broker, settings.store)
    declare_all(backends, settings, [])
    args = ["provision-clients", str(config), "--count", "2", "--prefix", f"{job}-"]
    out = tmp_path / "secrets"
    result = CliRunner().invoke(cli, [*args, "--out", str(out)], catch_exceptions=False)
    names = [f"{job}-0", f"{job}-1"]
    try:
        assert result.exit_code == 0, result.output
        yield settings, {name: read_env(out, job, name) for name in names}, config
    finally:
        revoked = CliRunner().invoke(cli, [*args, "--revoke"], catch_exceptions=False)
        kept = [q for n in names for q in client_queue_names(job, n)]
        kept += [q for n in names for q in own_queues(read_env(out, job, n), job, n)]
        left = surviving_queues(backends, kept)
        delete_all(backends, settings, names)
        assert revoked.exit_code == 0, revoked.output
        # `--revoke` deletes the durable reply queues it declared, not only the users.
        assert left == [], left


# Module-scoped: provisioning runs `rabbitmqctl` (an Erlang VM start each) five times and
# revoking twice more, so the tests that only use a job's users share them; each drains what
# it puts on the job's queues.
@pytest.fixture(scope="module")
def provisioned(
    amqp_url: str, redis_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Provisioned]:
    yield from provision("sfl_v2", amqp_url, redis_url, tmp_path_factory)


@pytest.fixture(scope="module")
def provisioned_splitgp(
    amqp_url: str, redis_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Provisioned]:
    yield from provision("splitgp", amqp_url, redis_url, tmp_path_factory)


def read_env(out: Path, job: str, client: str) -> dict[str, str]:
    """The variables of the env file `provision-clients` wrote for `client` of `job`."""
    lines = (out / f"{client_user(job, client)}.env").read_text().splitlines()
    return dict(line.split("=", 1) for line in lines if "=" in line)


def surviving_queues(backends: Backends, queues: list[str]) -> list[str]:
    """Which of `queues` exist (and delete them, so a failed check leaves nothing behind)."""
    broker = backends.open_broker("test-teardown-queues")
    found = []
    try:
        for queue in queues:
            try:
                broker.queue_depth(queue)
            except BrokerError:
                continue  # NOT_FOUND
            found.append(queue)
            broker.delete_queue(queue)
    finally:
        broker.close()
    return found


def own_queues(env: dict[str, str], job: str, client: str) -> list[str]:
    """The real names of `client`'s (reply, inference reply) queues: hidden by the password
    in its env file (services/security/hidden.py)."""
    secret = queue_secret(True, env["SPLITMQ_AMQP_URL"])
    return client_queue_names(job, client, client_hidden(job, client, secret))


def client_handle(env: dict[str, str], name: str) -> RabbitMQBroker:
    settings = load_settings(None, env)
    assert settings.broker.passive_declare and settings.security.per_client_users
    options = RabbitMQOptions(passive_declare=True, give_up_after=10.0, connection_name=name)
    return RabbitMQBroker(settings.broker.amqp_url, options)


def dead_letters(broker: Broker, job: str) -> dict[str, tuple[str, str]]:
    """message id → (reason, original user) of the job's dead letters so far."""
    broker.subscribe(dead_queue_name(job), prefetch=100)
    found: dict[str, tuple[str, str]] = {}
    while (delivery := broker.get(1.0)) is not None:
        broker.ack(delivery)
        reason = str(delivery.headers.get(REASON_HEADER, ""))
        found[delivery.message_id or ""] = (reason, str(delivery.headers.get(USER_HEADER, "")))
    return found


def test_clients_are_confined_and_impostors_dead_lettered(
    provisioned: Provisioned,
) -> None:
    settings, envs, _ = provisioned
    job = settings.job.name
    a, b = sorted(envs)
    backends = Backends(settings.broker, settings.store)
    store = backends.open_store()
    services = backends.open_broker("test-services")
    alice = client_handle(envs[a], "test-client-a")
    try:
        # Confinement: own queue yes, anyone else's no; no declaring, no forged replies.
        mine = client_reply_queue(job, a, queue_secret(True, envs[a]["SPLITMQ_AMQP_URL"]))
        alice.declare([mine])  # passive: provisioning declared it
        alice.subscribe(mine.name, prefetch=10)
        with pytest.raises(BrokerError, match="ACCESS_REFUSED") as refused:
            alice.subscribe(own_queues(envs[b], job, b)[0], prefetch=10)
        assert f"user '{client_user(job, a)}'" in str(refused.value)
        declaring = RabbitMQBroker(envs[a]["SPLITMQ_AMQP_URL"], RabbitMQOptions(give_up_after=10))
        try:
            with pytest.raises(BrokerError, match="ACCESS_REFUSED"):
                declaring.declare([mine])  # not passive: needs configure
        finally:
            declaring.close()
        with pytest.raises(BrokerError, match="ACCESS_REFUSED"):
            alice.publish(REPLIES_EXCHANGE, reply_routing_key(job, b), b"forged gradient")

        strategy = build_strategy(settings.algorithm.name, settings.algorithm.params())
        ensure_initial_version(store, settings, strategy, logging.getLogger("test"))
        coordinator = Coordinator(settings, backends, poll_s=0.05)
        user = client_user(job, a)  # what a secured client's handle stamps on its publishes
        with running([coordinator.run]):
            claims_b = Join(job, b, new_message_id(), 0, 10)
            claims = PublishOptions(message_id="claims-b", user_id=user)
            alice.publish(CONTROL_EXCHANGE, job, encode(claims_b), claims)
            anonymous = Join(job, a, new_message_id(), 0, 10)
            alice.publish(
                CONTROL_EXCHANGE, job, encode(anonymous), PublishOptions(message_id="anonymous")
            )
            honest = Join(job, a, new_message_id(), 0, 10)
            alice.publish(
                CONTROL_EXCHANGE, job, encode(honest), PublishOptions("honest", user_id=user)
            )
            delivery = alice.get(WAIT_S)
            assert delivery is not None, "no Welcome for the honest Join"
            alice.ack(delivery)
            welcome = decode(delivery.body)
            # The coordinator stamps what it sends with the services' user, too.
            assert delivery.user_id == amqp_user(settings.broker.amqp_url)

        assert isinstance(welcome, Welcome) and welcome.client == a
        found = dead_letters(services, job)
        assert found["claims-b"] == (
            f"client {b!r} does not match the AMQP user {client_user(job, a)!r}",
            client_user(job, a),
        )
        assert "no AMQP user_id" in found["anonymous"][0]
        assert "honest" not in found
        assert coordinator.stats.dead_lettered == 2 and coordinator.stats.joined == 1
    finally:
        alice.close()
        services.close()
        store.close()


def test_split_inference_answers_a_client_in_its_own_name_only(
    provisioned_splitgp: Provisioned,
) -> None:
    """SplitGP's split inference in the secured mode: client A's requests are answered on its
    provisioned inference reply queue; a request A sends claiming to be B is dead-lettered
    with the reason (B gets nothing); A can read neither B's answers nor the infer queue."""
    settings, envs, config = provisioned_splitgp
    job = settings.job.name
    a, b = sorted(envs)
    backends = Backends(settings.broker, settings.store)
    store = backends.open_store()
    services = backends.open_broker("test-services")
    alice = client_handle(envs[a], "test-client-a")
    theta: BrokerTheta | None = None
    try:
        strategy = build_strategy(settings.algorithm.name, settings.algorithm.params())
        version = ensure_initial_version(store, settings, strategy, logging.getLogger("test"))
        model = job_model(settings)
        expected_theta = ServerModel(copy.deepcopy(model), settings.model.cut).eval()
        load_partial(expected_theta, store.read_blob(job, version, BlobRef(SERVER_PART)))
        z = torch.randn(5, *model.cut_shape(settings.model.cut))
        server = InferenceServer(
            settings, backends, worker_id="w-secured", model_factory=lambda: model, poll_s=0.05
        )
        with running([server.run]):
            # Published first: the one server handles it before A's own requests below.
            claims_b = InferRequest(job, b, new_message_id(), 0, 1, z)
            alice.publish(
                SMASHED_EXCHANGE,
                infer_routing_key(job),
                encode(claims_b),
                PublishOptions("claims-b", user_id=client_user(job, a)),
            )
            # A as a client process does it: its env file over the job's config.
            client_settings = load_settings(config, envs[a])
            client_backends = Backends(client_settings.broker, client_settings.store)
            theta = client_theta(client_settings, client_backends, a, timeout_s=WAIT_S)
            logits = theta(z)
        with torch.no_grad():
            assert_close(logits, expected_theta(z))
        assert theta.last_version == version
        found = dead_letters(services, job)
        assert found["claims-b"] == (
            f"impostor: client {b!r} does not match the AMQP user {client_user(job, a)!r}",
            client_user(job, a),
        )
        assert server.stats.requests == 1 and server.stats.dead_lettered["impostor"] == 1
        b_infer = own_queues(envs[b], job, b)[1]
        assert services.queue_depth(b_infer) == 0
        # Confinement: neither B's answers nor the requests of others (their activations).
        for queue in (b_infer, infer_queue_name(job)):
            with pytest.raises(BrokerError, match="ACCESS_REFUSED"):
                alice.subscribe(queue, prefetch=10)
    finally:
        if theta is not None:
            theta.close()
        alice.close()
        services.close()
        store.close()


def test_a_client_may_not_forge_dead_letters_yet_its_bad_replies_reach_the_dead_queue(
    provisioned: Provisioned,
) -> None:
    """`splitmq.dead` is not the clients' to write (forged dead letters, a flooded
    `<job>.dead`); the client's own handle dead-letters a bad reply by rejecting it, and the
    reply queue's x-dead-letter routing (declared by provisioning) still lands it there."""
    settings, envs, config = provisioned
    job = settings.job.name
    a = sorted(envs)[0]
    services = Backends(settings.broker, settings.store).open_broker("test-services")
    forger = client_handle(envs[a], "test-forger")
    client: Broker | None = None
    try:
        with pytest.raises(BrokerError, match="ACCESS_REFUSED"):
            forger.publish(
                DEAD_EXCHANGE,
                job,
                b"forged dead letter",
                PublishOptions(user_id=client_user(job, a)),
            )
        # A's handle as `splitmq client` opens it: its env file over the job's config.
        client_settings = load_settings(config, envs[a])
        backends = Backends(client_settings.broker, client_settings.store)
        client = secured_client_broker(client_settings, backends, a, "test-client-a")
        mine = own_queues(envs[a], job, a)[0]
        client.declare(
            [client_reply_queue(job, a, queue_secret(True, envs[a]["SPLITMQ_AMQP_URL"]))]
        )
        client.subscribe(mine, prefetch=10)
        services.publish(
            REPLIES_EXCHANGE,
            reply_routing_key(job, a),
            b"\x00garbage",
            PublishOptions(message_id="bad-reply"),
        )
        delivery = client.get(WAIT_S)
        assert delivery is not None and delivery.message_id == "bad-reply"
        client.dead_letter(delivery, "undecodable reply")
        services.subscribe(dead_queue_name(job), prefetch=10)
        dead = services.get(WAIT_S)
        assert dead is not None, f"the bad reply never reached {dead_queue_name(job)}"
        services.ack(dead)
        assert (dead.message_id, dead.body) == ("bad-reply", b"\x00garbage")
        # Rejected and routed by RabbitMQ, not published by A.
        assert dead.headers.get("x-first-death-reason") == "rejected"
        assert dead.headers.get("x-first-death-queue") == mine
        assert services.queue_depth(mine) == 0
    finally:
        if client is not None:
            client.close()
        forger.close()
        services.close()


def test_a_client_publishes_into_its_own_job_only(provisioned: Provisioned) -> None:
    """Issue 33: a client user of one job landed a message in another job's control and shard
    queues (its write permission named the exchanges, any routing key). RabbitMQ's topic
    permissions now refuse every key but its own job's, and nothing reaches the other job."""
    settings, envs, _ = provisioned
    job, other = settings.job.name, f"{settings.job.name}x"  # `other` shares job's prefix
    a = sorted(envs)[0]
    services = Backends(settings.broker, settings.store).open_broker("test-services")
    alice = client_handle(envs[a], "test-cross-job")
    others = job_queues(other, 1)
    try:
        services.declare(others)
        options = PublishOptions(message_id="cross-job", user_id=client_user(job, a))
        refused = [
            (CONTROL_EXCHANGE, other),  # its Joins, Heartbeats, Leaves
            (CONTROL_EXCHANGE, updates_routing_key(other)),  # its WeightsUpdates
            (SMASHED_EXCHANGE, shard_routing_key(other, 0)),  # its shard queue
            (SMASHED_EXCHANGE, infer_routing_key(other)),  # its inference requests
        ]
        for exchange, key in refused:
            with pytest.raises(BrokerError, match="ACCESS_REFUSED") as why:
                alice.publish(exchange, key, b"x", options)
            assert f"topic '{key}'" in str(why.value), why.value
        assert {s.name: services.queue_depth(s.name) for s in others} == {s.name: 0 for s in others}
        # Its own job's keys are still its to use (then drained: the module shares the job).
        own = [(CONTROL_EXCHANGE, job), (SMASHED_EXCHANGE, shard_routing_key(job, 0))]
        for exchange, key in own:
            alice.publish(exchange, key, b"x", options)
        shard = shard_queue_name(job, 0)
        assert services.queue_depth(control_queue_name(job)) == services.queue_depth(shard) == 1
        for name in (control_queue_name(job), shard):
            services.subscribe(name, prefetch=1)
            delivery = services.get(WAIT_S)
            assert delivery is not None and delivery.message_id == "cross-job"
            services.ack(delivery)
            services.unsubscribe(name)
    finally:
        for spec in others:
            services.delete_queue(spec.name)
        alice.close()
        services.close()


def test_a_client_cannot_find_another_clients_queues(provisioned: Provisioned) -> None:
    """Issue 33: RabbitMQ checks no permission on a passive declare, so client A could ask for
    B's reply queues by their guessable names and learn their depth (how many replies wait for
    B). Now B's queues are named with 128 bits only B's password gives: under the default
    names (or A's own password's) there are none, and yet B's replies reach B by its key."""
    settings, envs, _ = provisioned
    job = settings.job.name
    a, b = sorted(envs)
    services = Backends(settings.broker, settings.store).open_broker("test-services")
    alice = client_handle(envs[a], "test-snooper")
    guessed = client_queue_names(job, b)
    try:
        for name in guessed:
            with pytest.raises(BrokerError, match="NOT_FOUND"):
                alice.queue_depth(name)
        with_own_password = own_queues(envs[a], job, b)  # B's names hidden by A's password
        for name in with_own_password:
            with pytest.raises(BrokerError, match="NOT_FOUND"):
                alice.queue_depth(name)
        real = own_queues(envs[b], job, b)
        assert not set(real) & {*guessed, *with_own_password}
        assert [services.queue_depth(name) for name in real] == [0, 0]
        assert reads_its_reply_queue(envs[b], job, b, services)  # routed by key, as ever
    finally:
        alice.close()
        services.close()


def provision_cli(config: Path, prefix: str, out: Path, *extra: str) -> Result:
    args = ["provision-clients", str(config), "--count", "2", "--prefix", prefix]
    return CliRunner().invoke(cli, [*args, "--out", str(out), *extra], catch_exceptions=False)


def reads_its_reply_queue(env: dict[str, str], job: str, client: str, services: Broker) -> bool:
    """Whether `client` of `job` logs in with `env` and gets what is sent to its reply queue
    (False: RabbitMQ refused the login)."""
    try:
        handle = client_handle(env, f"test-{client}")
    except BrokerError as exc:
        assert "ACCESS_REFUSED" in str(exc) or "uthentication" in str(exc), exc
        return False
    try:
        handle.subscribe(own_queues(env, job, client)[0], prefetch=10)
        marker = new_message_id()
        services.publish(
            REPLIES_EXCHANGE,
            reply_routing_key(job, client),
            b"r",
            PublishOptions(message_id=marker),
        )
        delivery = handle.get(WAIT_S)
        assert delivery is not None and delivery.message_id == marker
        handle.ack(delivery)
        return True
    finally:
        handle.close()


def test_two_jobs_with_one_prefix_keep_their_own_users(
    job: str, amqp_url: str, redis_url: str, tmp_path: Path
) -> None:
    """Jobs X and Y provisioned with the same --prefix (and --out): both sets of clients log in
    and read their queues; revoking Y leaves X's users working; provisioning X's existing
    users again is refused without --force (nothing reset), and --force resets them."""
    admin_or_skip(amqp_url)
    prefix, out = f"{job}-", tmp_path / "secrets"
    names = [f"{prefix}0", f"{prefix}1"]
    jobs = {"x": f"{job}x", "y": f"{job}y"}
    configs = {}
    for key, name in jobs.items():
        configs[key] = tmp_path / f"{key}.toml"
        text = CONFIG.format(amqp_url=amqp_url, redis_url=redis_url, job=name, algorithm="sfl_v2")
        configs[key].write_text(text)
    settings = load_settings(configs["x"], {})
    services = Backends(settings.broker, settings.store).open_broker("test-services")
    try:
        for key in ("x", "y"):
            done = provision_cli(configs[key], prefix, out)
            assert done.exit_code == 0, done.output
        envs = {(k, n): read_env(out, jobs[k], n) for k in jobs for n in names}
        for (key, name), env in envs.items():
            assert reads_its_reply_queue(env, jobs[key], name, services), (key, name)

        revoked = provision_cli(configs["y"], prefix, out, "--revoke")
        assert revoked.exit_code == 0, revoked.output
        for name in names:
            assert reads_its_reply_queue(envs["x", name], jobs["x"], name, services), name
            assert not reads_its_reply_queue(envs["y", name], jobs["y"], name, services), name

        again = provision_cli(configs["x"], prefix, out)
        assert again.exit_code == 1
        users = ", ".join(client_user(jobs["x"], n) for n in names)
        assert f"RabbitMQ users {users} exist already" in again.output, again.output
        assert "--force" in again.output and "Traceback" not in again.output
        assert read_env(out, jobs["x"], names[0]) == envs["x", names[0]]  # file untouched
        assert reads_its_reply_queue(envs["x", names[0]], jobs["x"], names[0], services)

        forced = provision_cli(configs["x"], prefix, out, "--force")
        assert forced.exit_code == 0, forced.output
        new = read_env(out, jobs["x"], names[0])
        assert not reads_its_reply_queue(envs["x", names[0]], jobs["x"], names[0], services)
        assert reads_its_reply_queue(new, jobs["x"], names[0], services)
    finally:
        for key in ("x", "y"):
            provision_cli(configs[key], prefix, out, "--revoke")
        services.close()
