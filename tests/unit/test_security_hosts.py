"""Client hosts in the secured mode without a server: the host's user, whose clients it may
speak for, its permissions and its provisioning. Against the real RabbitMQ:
tests/integration/test_secured_hosts.py."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from broker.errors import BrokerError
from broker.memory_broker import InMemoryBroker
from broker.messages import Join, new_message_id
from broker.topology import (
    CONTROL_EXCHANGE,
    SMASHED_EXCHANGE,
    host_queue,
    host_queue_name,
    reply_queue_name,
)
from services.config.loading import load_settings
from services.coordinator.hosts import join_host_problem
from services.security.hidden import hidden_of, host_reply_queue, queue_secret
from services.security.identity import (
    SenderCheck,
    amqp_user,
    client_host,
    host_id_problem,
    host_user,
    user_client,
    user_host,
)
from services.security.provision import (
    ClientOfHostError,
    host_names,
    host_permissions,
    provision,
    revoke,
)
from tests.unit.test_security import FakeAdmin, delivery


def test_a_hosts_clients_are_named_after_it() -> None:
    assert client_host("edge-0") == "edge" and client_host("edge-999") == "edge"
    assert client_host("a-1-0") == "a-1"  # the last '-' splits: an index has none
    assert client_host("edge--1") == "edge-"
    for not_hosted in ("edge", "edge-", "-3", "edge-01", "edge-x", "edge-1.5"):
        assert client_host(not_hosted) is None, not_hosted
    assert client_host("x" * 49 + "-0") is None  # a host id is at most 48 characters
    assert host_id_problem("x" * 48) is None and host_id_problem("x" * 49) is not None
    assert host_id_problem("a.b") is not None


def test_a_host_user_is_no_client_user() -> None:
    assert host_user("j", "edge") == "j.host.edge"
    assert user_host("j", "j.host.edge") == "edge"
    assert user_client("j", "j.host.edge") is None  # a client id has no '.'
    for other in ("j.edge", "k.host.edge", "j.host.", "j.host.a.b", "j.hostedge"):
        assert user_host("j", other) is None, other


@pytest.mark.parametrize(
    ("user", "client", "ok"),
    [
        ("j.host.edge", "edge-3", True),
        ("j.edge-3", "edge-3", True),  # the client's own user still may
        ("j.host.edge", "other-3", False),
        ("j.host.edge", "edge", False),  # the host's own id is none of its clients
        ("j.host.edge", "edge-03", False),
        ("k.host.edge", "edge-3", False),  # another job's host
        ("j.host.edge-3", "edge-3", False),
    ],
)
def test_a_host_speaks_for_its_own_clients_only(user: str, client: str, ok: bool) -> None:
    problem = SenderCheck(True, frozenset({"svc"}), job="j").client_problem(delivery(user), client)
    assert (problem is None) == ok, problem


def test_a_host_heartbeat_comes_from_the_host_user_only() -> None:
    check = SenderCheck(True, frozenset({"svc"}), job="j")
    assert check.host_problem(delivery("j.host.edge"), "edge") is None
    problem = check.host_problem(delivery("j.host.edge"), "core")
    assert problem == "host 'core' does not match the AMQP user 'j.host.edge'"
    assert "j.edge-0" in (check.host_problem(delivery("j.edge-0"), "edge") or "")
    assert "no AMQP user_id" in (check.host_problem(delivery(None), "edge") or "")
    assert SenderCheck(False, job="j").host_problem(delivery(None), "edge") is None


def test_a_host_reads_only_its_own_queue_and_configures_nothing() -> None:
    p = host_permissions("job-1", "edge", "pw")
    own = host_reply_queue("job-1", "edge", "pw").name
    assert re.fullmatch(p.configure, "") and not re.search(p.configure, own)
    assert re.search(p.write, SMASHED_EXCHANGE) and re.search(p.write, CONTROL_EXCHANGE)
    assert not re.search(p.write, "splitmq.replies") and not re.search(p.write, "splitmq.dead")
    assert re.search(p.read, own) and not re.search(p.read, host_queue_name("job-1", "edge"))
    assert not re.search(p.read, host_reply_queue("job-1", "edge", "other").name)
    p = host_permissions("job-1", "edge")  # the name unhidden (what the checks below read)
    others = ("job-1.host.edge2", "job-1.host.edg", "job-1.host.core", "job-1.control")
    for other in (*others, reply_queue_name("job-1", "edge-0"), "job-1.dead", "jobx1.host.edge"):
        assert not re.search(p.read, other), other


def test_hosts_are_provisioned_with_their_queue_and_revoked(tmp_path: Path) -> None:
    admin = FakeAdmin()
    services = InMemoryBroker(admin.hub)
    written = provision(
        admin, services, job="j", clients=["solo-a"], hosts=host_names("edge, core"),
        vhost="/", url_template="amqp://svc:x@mq/", out_dir=tmp_path,
    )  # fmt: skip
    assert [c.name for c in written] == ["solo-a", "edge", "core"]
    assert admin.users() == {"j.solo-a", "j.host.edge", "j.host.core"}
    edge = written[1]
    assert edge.path.name == "j.host.edge.env"
    env = dict(line.split("=", 1) for line in edge.path.read_text().splitlines() if "=" in line)
    settings = load_settings(None, {**env, "SPLITMQ_JOB__NAME": "j"})
    assert amqp_user(settings.broker.amqp_url) == "j.host.edge"
    assert settings.broker.passive_declare and settings.security.per_client_users
    secret = queue_secret(True, settings.broker.amqp_url)
    assert secret == edge.password
    queue = host_reply_queue("j", "edge", secret)
    assert admin.permissions[("/", "j.host.edge")] == host_permissions("j", "edge", secret)
    assert services.queue_depth(queue.name) == 0  # declared for it, under its hidden name
    with pytest.raises(BrokerError, match="NOT_FOUND"):
        services.queue_depth(host_queue_name("j", "edge"))  # and under no guessable one

    # Again with --force: a new password, a new name; the earlier queue (and one of the
    # default name, from before names were hidden) are gone.
    services.declare([host_queue("j", "edge")])
    again = provision(
        admin, services, job="j", clients=[], hosts=["edge"], force=True,
        vhost="/", url_template="amqp://svc:x@mq/", out_dir=tmp_path,
    )  # fmt: skip
    renamed = host_reply_queue("j", "edge", again[0].password).name
    assert renamed != queue.name and services.queue_depth(renamed) == 0
    for gone in (queue.name, host_queue_name("j", "edge")):
        with pytest.raises(BrokerError, match="NOT_FOUND"):
            services.queue_depth(gone)

    core = host_reply_queue("j", "core", written[2].password).name
    revoke(admin, services, job="j", clients=[], hosts=["edge"])
    assert admin.users() == {"j.solo-a", "j.host.core"}
    assert services.queue_depth(core) == 0
    with pytest.raises(BrokerError, match="NOT_FOUND"):
        services.queue_depth(renamed)  # found by its prefix, without the password
    with pytest.raises(ValueError, match="--hosts"):
        host_names("ok,bad.id")


def test_a_client_of_a_hosts_shape_is_never_provisioned_beside_it(tmp_path: Path) -> None:
    admin = FakeAdmin()
    services = InMemoryBroker(admin.hub)
    args: dict[str, Any] = {
        "job": "j", "vhost": "/", "url_template": "amqp://svc:x@mq/", "out_dir": tmp_path,
    }  # fmt: skip
    with pytest.raises(ClientOfHostError, match=r"edge-1 .* host edge"):
        provision(admin, services, clients=["edge-1"], hosts=["edge"], **args)
    assert admin.users() == set()
    provision(admin, services, clients=["edge-1"], **args)
    with pytest.raises(ClientOfHostError, match="edge-1"):  # the client exists already
        provision(admin, services, clients=[], hosts=["edge"], force=True, **args)
    provision(admin, services, clients=[], hosts=["core"], **args)
    with pytest.raises(ClientOfHostError, match="core-7"):  # the host exists already
        provision(admin, services, clients=["core-7"], **args)
    assert admin.users() == {"j.edge-1", "j.host.core"}


def test_a_host_queue_name_is_the_default_or_the_default_and_32_hex_digits() -> None:
    default = host_queue_name("j", "edge")
    hidden = host_reply_queue("j", "edge", "pw").name
    assert hidden_of(default, default) == ""
    assert hidden_of(hidden, default) == hidden[len(default) + 1 :]
    assert len(hidden_of(hidden, default) or "") == 32
    bad = [
        f"{default}.",
        f"{default}.{'0' * 31}",
        f"{default}.{'0' * 33}",
        f"{default}.{'A' * 32}",  # lowercase only
        f"{default}.{'g' * 32}",
        f"{default}.{'0' * 32}\n",
        f"{default}x.{'0' * 32}",
        f"{default}.{'0' * 32}.{'0' * 32}",
        host_queue_name("j", "edge2"),
        host_queue_name("j", "core", "0" * 32),
        host_queue_name("k", "edge", "0" * 32),  # another job's
        reply_queue_name("j", "edge-0"),
        "j.control",
        "j.dead",
        "",
    ]
    for name in bad:
        assert hidden_of(name, default) is None, name


def test_a_join_through_a_host_names_that_hosts_queue_or_none() -> None:
    def join(info: dict[str, str]) -> Join:
        return Join("j", "edge-0", new_message_id(), 0, 10, 0, info)

    hidden = host_reply_queue("j", "edge", "pw").name
    assert join_host_problem(join({"host": "edge"})) is None  # a host of an earlier release
    assert join_host_problem(join({"host": "edge", "host_queue": "j.host.edge"})) is None
    assert join_host_problem(join({"host": "edge", "host_queue": hidden})) is None
    for name in ("j.host.core", "j.reply.edge-0", f"{hidden}0", "j.host.edge." + "x" * 500):
        problem = join_host_problem(join({"host": "edge", "host_queue": name}))
        assert problem is not None and problem.startswith(
            f"Join of client 'edge-0' names host queue {name[:200]!r}: host 'edge''s queue is "
            "'j.host.edge', or that name, '.' and 32 lowercase hex digits"
        ), problem
