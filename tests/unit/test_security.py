"""The secured deployment without a server: settings, TLS parameters, who may send what,
per-client permissions and their provisioning, client health without Redis.

The same against the real RabbitMQ: tests/integration/test_secured_mode.py.
"""

from __future__ import annotations

import os
import re
import shutil
import ssl
import stat
import subprocess
import threading
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import redis

from broker.codec import encode
from broker.errors import BrokerError
from broker.memory_broker import InMemoryBroker, InMemoryHub
from broker.messages import Heartbeat, new_message_id
from broker.rabbitmq_connection import RabbitMQOptions, connection_parameters
from broker.redis_store import RedisStoreOptions, RedisWeightStore
from broker.store import WeightStore
from broker.tls import TLSOptions
from broker.topology import (
    CONTROL_EXCHANGE,
    SMASHED_EXCHANGE,
    client_infer_reply_queue,
    client_queue_names,
    control_queue,
    infer_reply_queue_name,
    infer_routing_key,
    reply_queue,
    reply_queue_name,
    shard_routing_key,
    updates_routing_key,
)
from broker.transport import Delivery, PublishOptions
from services.cli.common import require_servers
from services.client.client import Client
from services.client.errors import ClientError
from services.client.secured import secured_client_broker
from services.common.backends import Backends, Embedded, tls_options
from services.common.health import FileHealthBeat, assess_files
from services.config.loading import load_settings
from services.config.root import Settings
from services.config.settings import TLSSettings
from services.report.sinks import RecordsOnly
from services.runtime.embedded import run_embedded
from services.runtime.roles import embedded_roles
from services.security.admin import (
    ManagementAdmin,
    Permissions,
    RabbitmqctlAdmin,
    TopicPermission,
)
from services.security.hidden import client_hidden, client_reply_queue, queue_secret
from services.security.identity import (
    SenderCheck,
    amqp_user,
    client_id_problem,
    client_user,
    default_client_id,
    sender_check,
    service_user,
    user_client,
)
from services.security.provision import (
    UsersExistError,
    client_names,
    client_permissions,
    client_url,
    host_permissions,
    provision,
    revoke,
    vhost_of,
)

# --- settings -----------------------------------------------------------------------------------


def test_the_security_section_and_its_environment_overrides(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text('[security]\nper_client_users = true\nservice_users = ["ops"]\n')
    settings = load_settings(path, {})
    assert settings.security.per_client_users is True
    assert settings.security.service_users == ("ops",)
    env = {
        "SPLITMQ_SECURITY__SERVICE_USERS": "svc, other ,",
        "SPLITMQ_BROKER__PASSIVE_DECLARE": "1",
    }
    settings = load_settings(path, env)
    assert settings.security.service_users == ("svc", "other")
    assert settings.broker.passive_declare is True
    assert load_settings(None, {}).security.per_client_users is False


# --- TLS ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def certificate(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A self-signed certificate and its key (openssl, as an operator would make one)."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    folder = tmp_path_factory.mktemp("tls")
    cert, key = folder / "cert.pem", folder / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-subj", "/CN=broker.test", "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True, timeout=60,
    )  # fmt: skip
    return cert, key


def test_amqps_verifies_the_server_with_the_configured_files(
    certificate: tuple[Path, Path],
) -> None:
    cert, key = certificate
    tls = TLSOptions(ca_file=str(cert), cert_file=str(cert), key_file=str(key))
    params = connection_parameters(
        "amqps://u:p@broker.test:5671/%2F", RabbitMQOptions(tls=tls), "name"
    )
    options = params.ssl_options
    assert options is not None and options.server_hostname == "broker.test"
    context = options.context
    assert context.verify_mode == ssl.CERT_REQUIRED and context.check_hostname
    assert context.minimum_version >= ssl.TLSVersion.TLSv1_2
    # The CA file is the only trust anchor loaded besides nothing: it holds our certificate.
    assert [c["subject"] for c in context.get_ca_certs()] == [((("commonName", "broker.test"),),)]
    assert params.port == 5671


def test_amqps_without_options_uses_the_system_cas_and_checks_the_name() -> None:
    params = connection_parameters("amqps://u:p@h.example:5671/%2F", RabbitMQOptions(), "n")
    assert params.ssl_options is not None
    assert params.ssl_options.server_hostname == "h.example"
    assert params.ssl_options.context.check_hostname
    no_name = TLSOptions(verify_hostname=False)
    params = connection_parameters("amqps://u:p@10.0.0.1/%2F", RabbitMQOptions(tls=no_name), "n")
    assert params.ssl_options is not None
    context = params.ssl_options.context
    assert not context.check_hostname and context.verify_mode == ssl.CERT_REQUIRED


def test_tls_files_with_a_plain_url_are_refused() -> None:
    with pytest.raises(ValueError, match="use amqps://"):
        connection_parameters("amqp://u:p@h/%2F", RabbitMQOptions(tls=TLSOptions()), "n")
    with pytest.raises(ValueError, match="use rediss://"):
        RedisWeightStore("redis://h:6379/0", RedisStoreOptions(tls=TLSOptions()))
    with pytest.raises(ValueError, match="key_file"):
        TLSOptions(key_file="k.pem")


def test_rediss_gets_the_configured_files(certificate: tuple[Path, Path]) -> None:
    cert, key = certificate
    tls = TLSOptions(ca_file=str(cert), cert_file=str(cert), key_file=str(key))
    store = RedisWeightStore("rediss://redis.test:6380/0", RedisStoreOptions(tls=tls))
    pool = store._db.client.connection_pool
    assert pool.connection_class is redis.connection.SSLConnection
    kwargs = pool.connection_kwargs
    assert (kwargs["ssl_ca_certs"], kwargs["ssl_certfile"], kwargs["ssl_keyfile"]) == (
        str(cert),
        str(cert),
        str(key),
    )
    assert kwargs["ssl_cert_reqs"] == "required" and kwargs["ssl_check_hostname"] is True
    connection: Any = pool.make_connection()  # builds the SSL context the way a connect would
    assert connection.ca_certs == str(cert) and connection.check_hostname is True


def test_the_settings_reach_both_connections(certificate: tuple[Path, Path]) -> None:
    cert, _ = certificate
    assert tls_options(TLSSettings()) is None  # defaults: plain URLs keep working
    section = TLSSettings(ca_file=str(cert), verify_hostname=False)
    assert tls_options(section) == TLSOptions(ca_file=str(cert), verify_hostname=False)
    settings = Settings.model_validate(
        {
            "store": {"kind": "redis", "redis_url": "rediss://r.test:6380/0", "tls": section},
        }
    )
    store = Backends(settings.broker, settings.store).open_store(wait=False)
    assert isinstance(store, RedisWeightStore)
    kwargs = store._db.client.connection_pool.connection_kwargs
    assert kwargs["ssl_ca_certs"] == str(cert) and kwargs["ssl_check_hostname"] is False


# --- who sent it ----------------------------------------------------------------------------------


def delivery(user: str | None) -> Delivery:
    return Delivery(b"", "q", "k", 1, user_id=user)


@pytest.mark.parametrize(
    ("secured", "user", "client", "problem"),
    [
        (False, None, "a", None),  # the open mode: nobody vouches, nothing to check
        (False, "j.a", "a", None),
        (False, "mallory", "a", "does not match the AMQP user 'mallory'"),
        (True, "j.a", "a", None),
        (True, None, "a", "no AMQP user_id"),
        (True, "mallory", "a", "does not match"),
        (True, "a", "a", "does not match the AMQP user 'a'"),  # not a user of job j
        (True, "k.a", "a", "does not match the AMQP user 'k.a'"),  # job k's client a
    ],
)
def test_client_messages_must_come_from_their_client(
    secured: bool, user: str | None, client: str, problem: str | None
) -> None:
    check = SenderCheck(secured, frozenset({"svc"}), job="j")
    found = check.client_problem(delivery(user), client)
    assert (found is None) if problem is None else (problem in (found or ""))


def test_round_markers_must_come_from_a_service_user_in_the_secured_mode() -> None:
    check = SenderCheck(True, frozenset({"svc", "ops"}))
    assert check.service_problem(delivery("svc"), "RoundEnd") is None
    assert check.service_problem(delivery("ops"), "RoundEnd") is None
    assert "only service users ['ops', 'svc']" in (check.service_problem(delivery("a"), "X") or "")
    assert check.service_problem(delivery(None), "X") is not None
    assert SenderCheck(False, frozenset({"guest"})).service_problem(delivery("a"), "X") is None


def test_client_ids_are_plain_names() -> None:
    assert client_id_problem("client-7_b") is None
    for bad in ("", "a.b", "a b", "x" * 65, "é", "a/b", "a\n"):
        assert client_id_problem(bad) is not None, bad
    assert amqp_user("amqp://client%2D1:pw@h/%2F") == "client-1"
    assert amqp_user("amqp://h:5672/%2F") == "guest"


def test_a_client_user_names_its_job_and_its_client() -> None:
    assert client_user("job-1", "client-0") == "job-1.client-0"
    assert user_client("job-1", "job-1.client-0") == "client-0"
    for other in ("client-0", "job-2.client-0", "job-1.", "job-1.a.b", "job-10.client-0"):
        assert user_client("job-1", other) is None, other
    secured = {"security": {"per_client_users": True}, "job": {"name": "j"}}
    url = {"broker": {"kind": "rabbitmq", "amqp_url": "amqp://j.c-3:pw@h/%2F"}}
    assert default_client_id(Settings.model_validate({**secured, **url})) == "c-3"
    # Not a client of this job: the user itself, which the client's handle then refuses.
    plain = {"broker": {"kind": "rabbitmq", "amqp_url": "amqp://ops:pw@h/%2F"}}
    assert default_client_id(Settings.model_validate({**secured, **plain})) == "ops"


def test_stamped_handles_publish_as_their_user() -> None:
    hub = InMemoryHub()
    reader = InMemoryBroker(hub)
    reader.declare([control_queue("j")])
    reader.subscribe("j.control", prefetch=10)
    settings = Settings.model_validate(
        {"broker": {"amqp_url": "amqp://svc:pw@h/%2F"}, "security": {"per_client_users": True}}
    )
    assert service_user(settings) == "svc"
    stamped = InMemoryBroker(hub, stamp=service_user(settings))
    stamped.publish(CONTROL_EXCHANGE, "j", b"1")
    stamped.publish(CONTROL_EXCHANGE, "j", b"2", PublishOptions(user_id="other"))  # explicit wins
    got = [reader.get(1.0) for _ in range(2)]
    assert [d.user_id for d in got if d] == ["svc", "other"]
    open_mode = Settings.model_validate({})
    assert service_user(open_mode) is None
    assert sender_check(settings).secured and sender_check(open_mode).services == {"guest"}
    assert sender_check(settings).job == settings.job.name


@pytest.mark.parametrize("user", ["j.client-1", "client-2", "k.client-2"])
def test_a_secured_client_must_log_in_as_itself(user: str) -> None:
    settings = Settings.model_validate(
        {
            "broker": {"kind": "rabbitmq", "amqp_url": f"amqp://{user}:pw@127.0.0.1:1/%2F"},
            "security": {"per_client_users": True},
            "job": {"name": "j"},
        }
    )
    backends = Backends(settings.broker, settings.store)
    with pytest.raises(ClientError, match=f"as '{user}', not 'j.client-2'"):
        secured_client_broker(settings, backends, "client-2", "n")


def test_a_secured_client_declares_passively_and_stamps(monkeypatch: pytest.MonkeyPatch) -> None:
    opened: list[Any] = []

    class Recording(Backends):
        def open_broker(
            self, name: str = "", *, stamp: str | None = None, **_: object
        ) -> InMemoryBroker:
            opened.append(self.broker_settings)
            return InMemoryBroker(InMemoryHub(), stamp=stamp)

    settings = Settings.model_validate(
        {
            "broker": {"kind": "rabbitmq", "amqp_url": "amqp://j.c1:pw@h/%2F"},
            "security": {"per_client_users": True},
            "job": {"name": "j"},
        }
    )
    broker = secured_client_broker(settings, Recording(settings.broker, settings.store), "c1", "n")
    assert isinstance(broker, InMemoryBroker) and broker.stamp == "j.c1"
    assert opened[0].passive_declare is True
    assert opened[0].dead_letter_by_nack is True  # no write permission on splitmq.dead


# --- permissions and provisioning -----------------------------------------------------------------


def test_a_client_may_write_the_client_exchanges_and_read_only_its_reply_queue() -> None:
    p = client_permissions("job-1", "c-1")
    assert re.fullmatch(p.configure, "") and not re.search(p.configure, "job-1.reply.c-1")
    for exchange in (SMASHED_EXCHANGE, CONTROL_EXCHANGE):
        assert re.search(p.write, exchange), exchange
    # Not the dead-letter exchange: forged dead letters, a flooded `<job>.dead`.
    for other in ("splitmq.replies", "splitmq.events", "splitmq.dead", "amq.default", "",
                  "job-1.reply.c-1", "splitmq.smashed", "splitmq.control"):  # fmt: skip
        assert not re.search(p.write, other), other
    assert re.search(p.read, reply_queue_name("job-1", "c-1"))
    assert re.search(p.read, infer_reply_queue_name("job-1", "c-1"))  # split inference answers
    for other in ("job-1.reply.c-10", "job-1.reply.c-2", "jobx1.reply.c-1", "job-1.control",
                  "splitmq.replies", "job-1.dead", "job-1.infer", "job-1.infer-reply.c-2",
                  "job-1.infer-reply.c-10", "job-1.reply.c-1|job-1.infer-reply.c-1"):  # fmt: skip
        assert not re.search(p.read, other), other


def _keys(p: Permissions, exchange: str) -> Callable[[str], bool]:
    """Whether RabbitMQ's topic permissions let `p`'s user publish to `exchange` with a key."""
    (topic,) = [t for t in p.topics if t.exchange == exchange]
    assert topic.read == "^$"  # binds nothing (it may not bind at all: configure is ^$)
    return lambda key: re.search(topic.write, key) is not None


def test_a_client_publishes_only_with_its_own_jobs_routing_keys() -> None:
    # Issue 33: one job's client landed messages in another job's control and shard queues.
    p = client_permissions("a", "c-1")
    smashed, control = _keys(p, SMASHED_EXCHANGE), _keys(p, CONTROL_EXCHANGE)
    own = [shard_routing_key("a", 0), shard_routing_key("a", 17), infer_routing_key("a")]
    assert all(map(smashed, own))
    assert control("a") and control(updates_routing_key("a"))
    others = ["b.0", "ab.0", "a_.0", "b.infer", "a.0.0", "a.", "a.x", "a", "a.updates", "a.0|b.0"]
    assert not any(map(smashed, [*others, shard_routing_key("ab", 0), "A.0"]))
    assert not any(map(control, ["b", "ab", "b.updates", "a.0", "a.infer", "a.updatesx", ""]))
    # A host speaks for its clients: the same keys, of its job only.
    host = host_permissions("a", "edge")
    assert host.topics == p.topics


def test_a_job_name_with_a_dot_is_refused_its_users() -> None:
    # Job `a.updates`'s control key is job `a`'s updates key; settings refuse such names, and
    # so does provisioning.
    with pytest.raises(ValueError, match="holds a '\\.'"):
        client_permissions("a.updates", "c-1")


class FakeAdmin:
    """Users and permissions in dicts; the queues are those of `hub` (one vhost)."""

    name = "fake"

    def __init__(self) -> None:
        self.passwords: dict[str, str] = {}
        self.permissions: dict[tuple[str, str], Permissions] = {}
        self.hub = InMemoryHub()

    def queues(self, vhost: str) -> frozenset[str]:
        return frozenset(self.hub.queues)

    def users(self) -> frozenset[str]:
        return frozenset(self.passwords)

    def put_user(self, user: str, password: str) -> None:
        self.passwords[user] = password

    def set_permissions(self, vhost: str, user: str, permissions: Permissions) -> None:
        self.permissions[(vhost, user)] = permissions

    def delete_user(self, user: str) -> None:
        self.passwords.pop(user, None)


def real_names(admin: FakeAdmin, job: str, client: str) -> list[str]:
    """The names `provision` gave `client`'s queues: hidden by its password."""
    password = admin.passwords[client_user(job, client)]
    return client_queue_names(job, client, client_hidden(job, client, password))


def test_provisioning_creates_users_queues_and_secret_files(tmp_path: Path) -> None:
    admin = FakeAdmin()
    hub = admin.hub
    services = InMemoryBroker(hub)
    names = client_names("edge-", 2, start=3)
    written = provision(
        admin, services, job="j", clients=names, vhost="/", url_template="amqps://svc:x@mq:5671/",
        out_dir=tmp_path,
    )  # fmt: skip
    assert names == ["edge-3", "edge-4"] and admin.users() == {"j.edge-3", "j.edge-4"}
    password = admin.passwords["j.edge-3"]
    assert admin.permissions[("/", "j.edge-3")] == client_permissions("j", "edge-3", password)
    for creds in written:
        text = creds.path.read_text()
        assert creds.user == f"j.{creds.name}" and creds.path.name == f"j.{creds.name}.env"
        assert stat.S_IMODE(os.stat(creds.path).st_mode) == 0o600
        assert (
            f"SPLITMQ_AMQP_URL=amqps://{creds.user}:{admin.passwords[creds.user]}@mq:5671/%2F"
            in text
        )
        assert "SPLITMQ_SECURITY__PER_CLIENT_USERS=true" in text
        env = dict(line.split("=", 1) for line in text.splitlines() if "=" in line)
        settings = load_settings(None, {**env, "SPLITMQ_JOB__NAME": "j"})
        assert amqp_user(settings.broker.amqp_url) == creds.user
        assert default_client_id(settings) == creds.name  # `splitmq client` without --id
        assert settings.broker.passive_declare and settings.security.per_client_users
        assert settings.broker.dead_letter_by_nack
        # The reply queues exist, so the clients' passive declares find them, under the names
        # the client computes from the password in its env file.
        reply = client_reply_queue("j", creds.name, queue_secret(True, settings.broker.amqp_url))
        assert reply.name == real_names(admin, "j", creds.name)[0]
        assert services.queue_depth(reply.name) == 0
    assert services.queue_depth(real_names(admin, "j", "edge-4")[1]) == 0
    assert len(set(admin.passwords.values())) == 2  # a password each


def test_revoking_deletes_the_users_and_their_durable_reply_queues(tmp_path: Path) -> None:
    admin = FakeAdmin()
    hub = admin.hub
    services = InMemoryBroker(hub)
    names = client_names("edge-", 2)
    provision(
        admin, services, job="j", clients=names, vhost="/", url_template="amqp://svc:x@mq/",
        out_dir=tmp_path,
    )  # fmt: skip
    kept = real_names(admin, "j", "edge-1")
    gone = real_names(admin, "j", "edge-0")
    revoke(admin, services, job="j", clients=["edge-0"])
    assert admin.users() == {"j.edge-1"}
    for queue in gone:
        with pytest.raises(BrokerError, match="NOT_FOUND"):
            services.queue_depth(queue)
    assert [services.queue_depth(q) for q in kept] == [0, 0]  # only the revoked client's go


def test_jobs_sharing_a_prefix_get_users_of_their_own(tmp_path: Path) -> None:
    admin = FakeAdmin()
    services = InMemoryBroker(admin.hub)
    names = client_names("edge-", 2)
    x = provision(
        admin, services, job="x", clients=names, vhost="/", url_template="amqp://svc:x@mq/",
        out_dir=tmp_path,
    )  # fmt: skip
    x_passwords = dict(admin.passwords)
    provision(
        admin, services, job="y", clients=names, vhost="/", url_template="amqp://svc:x@mq/",
        out_dir=tmp_path,
    )  # fmt: skip
    assert admin.users() == {"x.edge-0", "x.edge-1", "y.edge-0", "y.edge-1"}
    assert {u: admin.passwords[u] for u in x_passwords} == x_passwords  # x's not reset
    assert all(creds.path.exists() for creds in x)  # nor its env files overwritten
    password = admin.passwords["x.edge-0"]
    assert admin.permissions[("/", "x.edge-0")] == client_permissions("x", "edge-0", password)
    revoke(admin, services, job="y", clients=names)
    assert admin.users() == {"x.edge-0", "x.edge-1"}
    assert services.queue_depth(real_names(admin, "x", "edge-0")[0]) == 0


def test_secured_queue_names_hide_128_bits_of_the_clients_password() -> None:
    """Issue 33: a passive declare needs no permission, so a guessable name shows the queue's
    depth to anyone. The hidden part depends on the password, the job and the client; the open
    mode (no secret) keeps the default names."""
    assert client_reply_queue("j", "c-1", "") == reply_queue("j", "c-1")
    assert client_hidden("j", "c-1", "") == ("", "")
    reply, infer = client_hidden("j", "c-1", "pw")
    assert re.fullmatch("[0-9a-f]{32}", reply) and re.fullmatch("[0-9a-f]{32}", infer)
    assert reply != infer
    others = [client_hidden(*args) for args in (("j", "c-1", "pw2"), ("j", "c-2", "pw"))]
    others.append(client_hidden("k", "c-1", "pw"))
    assert all(reply not in other and infer not in other for other in others)
    spec = client_reply_queue("j", "c-1", "pw")
    assert spec.name == f"{reply_queue_name('j', 'c-1')}.{reply}"
    assert spec.routing_key == reply_queue("j", "c-1").routing_key  # the services' key
    assert queue_secret(True, "amqp://j.c-1:p%2Fw@mq/") == "p/w"
    assert queue_secret(False, "amqp://j.c-1:pw@mq/") == ""


def test_a_standalone_client_consumes_the_name_its_password_hides() -> None:
    """What `splitmq client` declares (passively) and consumes: the hidden name in the secured
    mode, the default one in the open mode."""
    url = "amqp://j.c-1:pw%2F1@mq/%2F"
    env = {"SPLITMQ_JOB__NAME": "j", "SPLITMQ_DATA__DATASET": "fashion_mnist_sample"}
    names = {}
    for secured in (True, False):
        mode = {"SPLITMQ_SECURITY__PER_CLIENT_USERS": str(secured).lower()}
        settings = load_settings(None, {**env, **mode, "SPLITMQ_AMQP_URL": url})
        client = Client(settings, Backends(settings.broker, settings.store), client_id="c-1")
        names[secured] = client.reply_queue().name
    assert names == {
        True: client_reply_queue("j", "c-1", "pw/1").name,
        False: reply_queue_name("j", "c-1"),
    }


def test_reprovisioning_and_revoking_drop_the_queues_of_earlier_names(tmp_path: Path) -> None:
    """Upgrade: queues of the default names (earlier releases) or of an earlier password are
    nobody's after a --force; revoking finds them without the password. Client `edge-1`'s
    prefix is no prefix of `edge-10`'s names."""
    admin = FakeAdmin()
    services = InMemoryBroker(admin.hub)
    old = [reply_queue("j", "edge-1"), client_infer_reply_queue("j", "edge-1")]
    services.declare(old)  # as an earlier release provisioned them
    args: dict[str, Any] = {
        "job": "j", "vhost": "/", "url_template": "amqp://svc:x@mq/", "out_dir": tmp_path,
    }  # fmt: skip
    provision(admin, services, clients=["edge-1", "edge-10"], **args)
    first = real_names(admin, "j", "edge-1")
    provision(admin, services, clients=["edge-1"], force=True, **args)
    now = real_names(admin, "j", "edge-1")
    assert set(admin.hub.queues) == {*now, *real_names(admin, "j", "edge-10")}
    assert not set(now) & {*first, *(spec.name for spec in old)}
    services.declare(old)  # left behind again
    revoke(admin, services, job="j", clients=["edge-1"])
    assert set(admin.hub.queues) == set(real_names(admin, "j", "edge-10"))


def test_provisioning_refuses_existing_users_of_the_job_unless_forced(tmp_path: Path) -> None:
    admin = FakeAdmin()
    services = InMemoryBroker(admin.hub)
    args: dict[str, Any] = {
        "job": "j", "vhost": "/", "url_template": "amqp://svc:x@mq/", "out_dir": tmp_path,
    }  # fmt: skip
    provision(admin, services, clients=["edge-1"], **args)
    before = dict(admin.passwords)
    with pytest.raises(UsersExistError, match=r"users j\.edge-1 exist already .*--force"):
        provision(admin, services, clients=["edge-0", "edge-1"], **args)
    assert admin.passwords == before  # nothing created or reset: edge-0 neither
    again = provision(admin, services, clients=["edge-0", "edge-1"], force=True, **args)
    assert admin.users() == {"j.edge-0", "j.edge-1"}
    assert admin.passwords["j.edge-1"] != before["j.edge-1"]
    assert again[1].password == admin.passwords["j.edge-1"]


def test_urls_and_vhosts() -> None:
    assert client_url("amqp://a:b@h:5672/v", "c", "p/w") == "amqp://c:p%2Fw@h:5672/v"
    assert client_url("amqp://h", "c", "p") == "amqp://c:p@h/%2F"
    assert vhost_of("amqp://h/%2F") == "/" and vhost_of("amqp://h/team") == "team"
    assert vhost_of("amqp://h") == "/"
    with pytest.raises(ValueError, match="bad client id"):
        client_names("a.", 1)


def test_rabbitmqctl_gets_passwords_on_stdin_and_resets_existing_users() -> None:
    calls: list[tuple[list[str], str]] = []

    def run(argv: Sequence[str], stdin: str) -> subprocess.CompletedProcess[str]:
        calls.append((list(argv), stdin))
        exists = {
            "old": "Error: user_already_exists: old",
            "j.c": 'Error:\nUser "j.c" already exists',  # RabbitMQ 3.10's words
        }
        said = exists.get(argv[2], "") if argv[1] == "add_user" else ""
        return subprocess.CompletedProcess(argv, 70 if said else 0, "", said)

    admin = RabbitmqctlAdmin(run=run)
    admin.put_user("new", "s3cret")
    admin.put_user("old", "pw2")
    topic = TopicPermission("x.topic", "^k$", "^$")
    admin.set_permissions("/", "new", Permissions("^$", "^w$", "^r$", topics=(topic,)))
    assert calls[0] == (["rabbitmqctl", "add_user", "new"], "s3cret")
    assert calls[2] == (["rabbitmqctl", "change_password", "old"], "pw2")
    assert calls[3][0] == [
        "rabbitmqctl",
        "set_permissions",
        "--vhost",
        "/",
        "new",
        "^$",
        "^w$",
        "^r$",
    ]
    assert calls[4][0] == [
        "rabbitmqctl",
        "set_topic_permissions",
        "--vhost",
        "/",
        "new",
        "x.topic",
        "^k$",
        "^$",
    ]
    assert all("s3cret" not in arg for argv, _ in calls for arg in argv)
    admin.put_user("j.c", "pw3")
    assert calls[-1] == (["rabbitmqctl", "change_password", "j.c"], "pw3")


def test_rabbitmqctl_lists_the_users_as_json() -> None:
    listing = '[\n{"user":"guest","tags":["administrator"]},\n{"user":"j.c-0","tags":[]}\n]\n'

    def run(argv: Sequence[str], stdin: str) -> subprocess.CompletedProcess[str]:
        assert list(argv) == ["rabbitmqctl", "list_users", "--quiet", "--formatter", "json"]
        return subprocess.CompletedProcess(argv, 0, listing, "")

    assert RabbitmqctlAdmin(run=run).users() == {"guest", "j.c-0"}


def test_both_admins_list_a_vhosts_queues() -> None:
    """What revoking a client finds its hidden queue names in."""

    def run(argv: Sequence[str], stdin: str) -> subprocess.CompletedProcess[str]:
        assert list(argv) == [
            "rabbitmqctl", "list_queues", "--vhost", "v/1", "--quiet", "--formatter", "json", "name"
        ]  # fmt: skip
        return subprocess.CompletedProcess(argv, 0, '[\n{"name":"j.reply.c.ab"}\n]\n', "")

    assert RabbitmqctlAdmin(run=run).queues("v/1") == {"j.reply.c.ab"}
    seen: list[str] = []

    def opener(request: urllib.request.Request, timeout: float) -> bytes:
        seen.append(request.full_url)
        return b'[{"name": "j.reply.c.ab"}, {"name": "j.dead"}]'

    admin = ManagementAdmin("http://mq:15672", "admin", "pw", opener=opener)
    assert admin.queues("v/1") == {"j.reply.c.ab", "j.dead"}
    assert seen == ["http://mq:15672/api/queues/v%2F1?columns=name"]


def test_the_management_api_is_called_with_basic_auth() -> None:
    seen: list[urllib.request.Request] = []

    def opener(request: urllib.request.Request, timeout: float) -> bytes:
        seen.append(request)
        listing = b'[{"name": "guest", "tags": ["administrator"]}]'
        return listing if request.method == "GET" else b"{}"

    admin = ManagementAdmin("http://mq:15672/", "admin", "pw", opener=opener)
    admin.put_user("c/1", "x")
    topic = TopicPermission("x.topic", "^k$", "^$")
    admin.set_permissions("/", "c/1", Permissions("^$", "^w$", "^r$", topics=(topic,)))
    assert admin.users() == {"guest"}
    assert [(r.get_method(), r.full_url) for r in seen] == [
        ("PUT", "http://mq:15672/api/users/c%2F1"),
        ("PUT", "http://mq:15672/api/permissions/%2F/c%2F1"),
        ("PUT", "http://mq:15672/api/topic-permissions/%2F/c%2F1"),
        ("GET", "http://mq:15672/api/users"),
    ]
    assert seen[0].get_header("Authorization") == "Basic YWRtaW46cHc="
    assert seen[1].data == b'{"configure": "^$", "write": "^w$", "read": "^r$"}'
    assert seen[2].data == b'{"exchange": "x.topic", "write": "^k$", "read": "^$"}'


# --- clients and Redis ----------------------------------------------------------------------------


class NoStore(Backends):
    """Backends whose store must never be opened."""

    def open_store(self, *, wait: bool = True) -> WeightStore:
        raise AssertionError("a client opened the store")


def test_a_client_role_never_opens_the_store() -> None:
    settings = Settings.model_validate(
        {
            "job": {"name": "nostore", "rounds": 1},
            "model": {"name": "cnn5", "cut": "block1"},
            "data": {"dataset": "fashion_mnist_sample"},
            "algorithm": {"name": "sfl_v2", "batch_size": 16, "max_steps_per_round": 3},
            "clients": {"count": 2, "min_to_start": 2},
        }
    )
    backends = Backends(settings.broker, settings.store, Embedded())

    def roles(s: Settings, b: Backends, sink: Any, data: Any) -> Any:
        specs = list(embedded_roles(s, b, sink, data))
        guarded = NoStore(b.broker_settings, b.store_settings, b.embedded)
        for i, spec in enumerate(specs):
            if spec.kind == "client":
                from services.runtime.roles import build_client

                role = build_client(s, guarded, client_id=spec.name, partition=int(spec.name[-1]))
                specs[i] = type(spec)(spec.name, spec.kind, role)
        return specs

    records: list[Any] = []

    class Sink:
        def record(self, record: Any) -> None:
            records.append(record)

        def finish(self, status: str) -> None:
            pass

    outcome = run_embedded(
        settings, sink=RecordsOnly(Sink()), stop=threading.Event(), build_roles=roles,
        backends=backends,
    )  # fmt: skip
    assert outcome.ok, outcome.traceback
    assert len(records) == 1


def test_clients_need_only_the_broker_to_run_as_a_process() -> None:
    settings = Settings.model_validate({"broker": {"kind": "rabbitmq"}})
    require_servers(settings, "client", store=False)  # no store configured: fine for a client
    import click

    with pytest.raises(click.ClickException, match="shared broker and store"):
        require_servers(settings, "worker")


def test_client_health_is_a_local_file(tmp_path: Path) -> None:
    clock = [1000.0]
    beat = FileHealthBeat("j", "client", "c7", base=tmp_path, clock=lambda: clock[0])
    assert not assess_files("j", "client", base=tmp_path, now=1000.0).ok
    with beat:
        beat.beat()
        verdict = assess_files("j", "client", instance="c7", base=tmp_path, now=1005.0)
        assert verdict.ok and "client c7 alive" in verdict.reason
        assert not assess_files("j", "client", instance="c8", base=tmp_path, now=1005.0).ok
        stale = assess_files("j", "client", base=tmp_path, now=1100.0)
        assert not stale.ok and "1 stale" in stale.reason
    assert not beat.path.exists()  # removed when the client stops


def test_a_dead_clients_file_is_unhealthy(tmp_path: Path) -> None:
    path = tmp_path / "j" / "client-x.json"
    path.parent.mkdir(parents=True)
    path.write_text('{"pid": 999999999, "at": 1000.0, "instance": "x"}')  # no such pid
    assert not assess_files("j", "client", base=tmp_path, now=1001.0).ok


def test_impostor_heartbeats_cannot_be_published_as_someone_else() -> None:
    hub = InMemoryHub()
    alice = InMemoryBroker(hub, user="alice")
    alice.declare([control_queue("j")])
    body = encode(Heartbeat("j", "bob", new_message_id(), 0))
    with pytest.raises(BrokerError, match="user_id 'bob' differs"):
        alice.publish(CONTROL_EXCHANGE, "j", body, PublishOptions(user_id="bob"))
