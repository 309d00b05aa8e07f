"""compose/docker-compose.cluster.yml and its host-network variant, merged over the base files
as Compose merges them, checked against the RabbitMQ and Sentinel configs they mount and
against the real config loader. No Docker needed (compose/smoke.sh --cluster runs them).
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import pytest
import yaml

from services.config.loading import load_settings
from services.config.root import Settings
from tests.unit.test_compose import (
    BASE_FILE,
    COMPOSE_DIR,
    HOSTNET_FILE,
    JOB_TOML,
    ROLES,
    conf_values,
    environment,
    interpolate,
    merge,
)

CLUSTER_FILE = COMPOSE_DIR / "docker-compose.cluster.yml"
CLUSTER_HOSTNET_FILE = COMPOSE_DIR / "docker-compose.cluster-hostnet.yml"
CLUSTER_SMOKE_TOML = COMPOSE_DIR / "cluster-smoke.toml"
SMOKE_SH = COMPOSE_DIR / "smoke.sh"
NODES = ("rabbitmq", "rabbitmq-2", "rabbitmq-3")
SENTINELS = ("sentinel-1", "sentinel-2", "sentinel-3")
AUTOSCALER = "autoscaler"
COOKIE = "0123456789abcdef"
# Ports that others own on these machines: the host's RabbitMQ and Redis, the single-node
# host-network stack (docker-compose.hostnet.yml) and scripts/cluster.sh (/tmp/h: issue 12).
TAKEN = {5672, 4369, 25672, 6379, 5673, 15673, 4370, 25673, 6380}
TAKEN |= {5701, 5702, 5703, 6390, 6391, 26390, 26391, 26392}

_REQUIRED = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*):\?([^}]*)\}")


def resolve(node: Any, env: Mapping[str, str]) -> Any:
    """Compose's interpolation, ${NAME:?message} (required) included."""
    if isinstance(node, str):

        def required(match: re.Match[str]) -> str:
            if not env.get(match[1]):
                raise ValueError(f"{match[1]}: {match[2]}")
            return env[match[1]].replace("$", "$$")

        return interpolate(_REQUIRED.sub(required, node), env)
    if isinstance(node, list):
        return [resolve(item, env) for item in node]
    if isinstance(node, dict):
        return {key: resolve(value, env) for key, value in node.items()}
    return node


def merged(*paths: Path, env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The services of `paths` merged in order, as `docker-compose -f a -f b config` does."""
    env = {"SPLITMQ_ERLANG_COOKIE": COOKIE} if env is None else env
    out: dict[str, Any] = {}
    for path in paths:
        data = resolve(yaml.safe_load(path.read_text()), env)
        for name, service in data["services"].items():
            out[name] = merge(out.get(name, {}), service)
    return out


@pytest.fixture(scope="module")
def bridge() -> dict[str, Any]:
    return merged(BASE_FILE, CLUSTER_FILE)


@pytest.fixture(scope="module")
def hostnet() -> dict[str, Any]:
    return merged(BASE_FILE, HOSTNET_FILE, CLUSTER_FILE, CLUSTER_HOSTNET_FILE)


def mounted_conf(service: Mapping[str, Any], target: str) -> Path:
    for spec in service["volumes"]:
        source, path = spec.split(":")[:2]
        if path == target:
            return (COMPOSE_DIR / source).resolve()
    raise AssertionError(f"nothing mounted at {target}")


def cluster_nodes(conf: Path) -> list[str]:
    values = conf_values(conf)
    assert values["cluster_formation.peer_discovery_backend"] == "classic_config"
    return [values[f"cluster_formation.classic_config.nodes.{i}"] for i in (1, 2, 3)]


def role_settings(services: Mapping[str, Any], role: str, job: Path) -> Settings:
    return load_settings(job, environment(services[role]))


def sentinel_config(service: Mapping[str, Any]) -> list[str]:
    """The sentinel.conf lines the service's shell command writes, with its environment
    (the container's hostname as HOSTNAME)."""
    script = service["command"][2].replace("$$", "$")
    env = environment(service)
    printf = script.split(" > /tmp/sentinel.conf")[0]
    lines = shlex.split(printf)[2:]  # printf '%s\n' LINE...

    def expand(text: str) -> str:
        text = re.sub(r"\$\{(\w+):-\$\(hostname\)\}", lambda m: env.get(m[1], "HOSTNAME"), text)
        return re.sub(r"\$\{(\w+):-([^}]*)\}", lambda m: env.get(m[1], m[2]), text)

    return [expand(line) for line in lines]


def test_the_cluster_refuses_to_start_without_a_cookie() -> None:
    with pytest.raises(ValueError, match="SPLITMQ_ERLANG_COOKIE"):
        merged(BASE_FILE, CLUSTER_FILE, env={})


def test_every_node_shares_the_cookie(bridge: dict[str, Any], hostnet: dict[str, Any]) -> None:
    for services in (bridge, hostnet):
        for node in NODES:
            assert environment(services[node])["RABBITMQ_ERLANG_COOKIE"] == COOKIE, node


def test_nodes_discover_each_other_by_the_names_they_have(bridge: dict[str, Any]) -> None:
    for node in NODES:
        conf = mounted_conf(bridge[node], "/etc/rabbitmq/conf.d/25-cluster.conf")
        # A node's name is rabbit@<hostname> in the official image and the stand-in.
        assert cluster_nodes(conf) == [f"rabbit@{bridge[n]['hostname']}" for n in NODES]
        # The base file's settings apply on every node (message size, consumer timeout).
        assert mounted_conf(bridge[node], "/etc/rabbitmq/conf.d/20-splitmq.conf").name == (
            "rabbitmq.conf"
        )


def test_later_nodes_wait_for_the_first(bridge: dict[str, Any]) -> None:
    # Started together, each could find no running peer and form a cluster of its own.
    for node in NODES[1:]:
        assert bridge[node]["depends_on"]["rabbitmq"]["condition"] == "service_healthy"
    assert "rabbitmq-2" not in bridge["rabbitmq"].get("depends_on", {})


@pytest.mark.parametrize("role", (*ROLES, AUTOSCALER))
def test_roles_wait_for_every_node_and_sentinel(bridge: dict[str, Any], role: str) -> None:
    # A quorum queue's members are the nodes in the cluster when it is declared.
    deps = bridge[role]["depends_on"]
    for service in (*NODES, "redis", *SENTINELS):
        assert deps[service]["condition"] == "service_healthy", (role, service)


@pytest.mark.parametrize("role", (*ROLES, AUTOSCALER))
def test_role_settings_name_the_cluster(bridge: dict[str, Any], role: str) -> None:
    settings = role_settings(bridge, role, JOB_TOML)
    assert [urlparse(u).hostname for u in settings.broker.urls] == list(NODES)
    assert all(urlparse(u).port == 5672 for u in settings.broker.urls)
    assert settings.broker.quorum and settings.broker.queue_type == "quorum"
    assert list(settings.store.sentinels) == [f"{s}:26379" for s in SENTINELS]
    for sentinel in SENTINELS:
        # The primary by its hostname, a quorum of 2 of the 3 Sentinels.
        assert "sentinel monitor splitmq redis 6379 2" in sentinel_config(bridge[sentinel])
    assert settings.store.master_name == "splitmq"


def test_sentinels_hand_out_names_that_survive_a_recreate(bridge: dict[str, Any]) -> None:
    for sentinel in SENTINELS:
        conf = sentinel_config(bridge[sentinel])
        assert {
            "port 26379",
            "sentinel resolve-hostnames yes",
            "sentinel announce-hostnames yes",
            "sentinel announce-ip HOSTNAME",
        } <= set(conf)
        assert bridge[sentinel]["hostname"] == sentinel
    for redis, name in (("redis", "redis"), ("redis-replica", "redis-replica")):
        command = bridge[redis]["command"]
        assert command[command.index("--replica-announce-ip") + 1] == name
        assert bridge[redis]["hostname"] == name
    replica = bridge["redis-replica"]["command"]
    assert replica[replica.index("--replicaof") + 1 :][:2] == ["redis", "6379"]
    # Both keep the base file's durability (fsync before every reply).
    for redis in ("redis", "redis-replica"):
        assert "always" in bridge[redis]["command"]


# --- host networking ----------------------------------------------------------------------


def test_hostnet_nodes_have_their_own_names_ports_and_port_mapper(hostnet: dict[str, Any]) -> None:
    names, amqp, management, dist = [], [], [], []
    for node in NODES:
        service = hostnet[node]
        assert service["network_mode"] == "host"
        env = environment(service)
        names.append(env["RABBITMQ_NODENAME"])
        assert env["ERL_EPMD_PORT"] == "4371"
        dist.append(int(env["RABBITMQ_DIST_PORT"]))
        conf = conf_values(mounted_conf(service, "/etc/rabbitmq/conf.d/30-hostnet.conf"))
        amqp.append(int(conf["listeners.tcp.default"].removeprefix("127.0.0.1:")))
        management.append(int(conf["management.tcp.port"]))
        discovery = mounted_conf(service, "/etc/rabbitmq/conf.d/25-cluster.conf")
        assert discovery.name == "hostnet-cluster-rabbitmq.conf"
    # Every node discovers the others by the names they were given.
    assert cluster_nodes(COMPOSE_DIR / "hostnet-cluster-rabbitmq.conf") == names
    assert len(set(names)) == len(NODES)
    ports = amqp + management + dist + [4371]
    assert len(set(ports)) == len(ports) and not set(ports) & TAKEN
    epmd = hostnet["epmd"]
    assert [epmd["entrypoint"][0], *epmd["command"][:2]] == ["epmd", "-port", "4371"]
    assert hostnet["rabbitmq"]["depends_on"]["epmd"]["condition"] == "service_healthy"
    for role in ROLES:
        settings = role_settings(hostnet, role, CLUSTER_SMOKE_TOML)
        assert [urlparse(u).port for u in settings.broker.urls] == amqp
        assert {urlparse(u).hostname for u in settings.broker.urls} == {"127.0.0.1"}


def test_hostnet_redis_and_sentinels(hostnet: dict[str, Any]) -> None:
    def port(service: str) -> int:
        command = hostnet[service]["command"]
        return int(command[command.index("--port") + 1])

    primary, replica = port("redis"), port("redis-replica")
    sentinel_ports = []
    for sentinel in SENTINELS:
        service = hostnet[sentinel]
        assert service["network_mode"] == "host"
        conf = sentinel_config(service)
        (line,) = [c for c in conf if c.startswith("port ")]
        sentinel_ports.append(int(line.removeprefix("port ")))
        assert f"sentinel monitor splitmq 127.0.0.1 {primary} 2" in conf
        assert "sentinel announce-ip 127.0.0.1" in conf
    command = hostnet["redis-replica"]["command"]
    assert command[command.index("--replicaof") + 1 :][:2] == ["127.0.0.1", str(primary)]
    ports = [primary, replica, *sentinel_ports]
    assert len(set(ports)) == len(ports) and not set(ports) & TAKEN
    for role in ROLES:
        settings = role_settings(hostnet, role, CLUSTER_SMOKE_TOML)
        assert list(settings.store.sentinels) == [f"127.0.0.1:{p}" for p in sentinel_ports]
        assert urlparse(settings.store.redis_url).port == primary
    # compose/smoke.sh --cluster reads the store on the primary's port and knows the job.
    smoke = SMOKE_SH.read_text()
    cluster_block = smoke[smoke.index('if [ "$MODE" = cluster ]; then') :]
    assert f"REDIS_PORT={primary}\n" in cluster_block
    job = load_settings(CLUSTER_SMOKE_TOML, {}).job.name
    assert f"JOB={job}\n" in cluster_block
