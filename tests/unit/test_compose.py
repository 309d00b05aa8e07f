"""compose/: the files are parsed and checked against the real CLI and config loader.

No Docker needed. The point: renaming a CLI command or option, or breaking the job config the
containers mount, fails here instead of in a crash-looping container.
"""

from __future__ import annotations

import re
import tomllib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import click
import pytest
import yaml

from services.cli.main import cli
from services.config.loading import load_settings
from services.config.root import Settings

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_DIR = ROOT / "compose"
BASE_FILE = COMPOSE_DIR / "docker-compose.yml"
GPU_FILE = COMPOSE_DIR / "docker-compose.gpu.yml"
DOCKERFILE = COMPOSE_DIR / "Dockerfile"
JOB_TOML = COMPOSE_DIR / "job.toml"
RABBITMQ_CONF = COMPOSE_DIR / "rabbitmq.conf"
DOCKERIGNORE = ROOT / ".dockerignore"

ROLES = ("coordinator", "aggregator", "worker", "client")
# `splitmq autoscale` with the Docker backend, in the `autoscale` profile.
AUTOSCALER = "autoscaler"
# `splitmq clients`, client hosts, in the `hosts` profile.
HOSTS = "clients"
SCALED = ("worker", "client")
CONTAINER_CONFIG = "/etc/splitmq/job.toml"

# ${NAME}, ${NAME:-default}, ${NAME-default}; $$ is a literal $ (compose interpolation).
_VAR = re.compile(r"\$\$|\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?-)([^}]*))?\}")


def interpolate(value: str, env: Mapping[str, str]) -> str:
    """Compose's variable substitution for the forms these files use."""

    def sub(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        name, op, default = match.group(1), match.group(2), match.group(3)
        if op == ":-":
            return env.get(name) or default
        if op == "-":
            return env.get(name, default)
        if name not in env:
            raise AssertionError(f"${{{name}}} has no default and is not set")
        return env[name]

    return _VAR.sub(sub, value)


def resolve(node: Any, env: Mapping[str, str]) -> Any:
    if isinstance(node, str):
        return interpolate(node, env)
    if isinstance(node, list):
        return [resolve(item, env) for item in node]
    if isinstance(node, dict):
        return {key: resolve(value, env) for key, value in node.items()}
    return node


def load_compose(path: Path, env: Mapping[str, str] | None = None) -> dict[str, Any]:
    data = yaml.safe_load(path.read_text())
    assert isinstance(data, dict), f"{path} is not a YAML mapping"
    resolved = resolve(data, env or {})
    assert isinstance(resolved, dict)
    return resolved


def environment(service: Mapping[str, Any]) -> dict[str, str]:
    env = service.get("environment", {})
    if isinstance(env, list):  # the ["KEY=value", ...] form
        return dict(item.split("=", 1) for item in env)
    return {key: str(value) for key, value in env.items()}


@dataclass(frozen=True)
class Mounts:
    """A service's volumes as container path → host path (named volumes → a scratch dir)."""

    paths: dict[str, Path]

    @classmethod
    def of(cls, service: Mapping[str, Any], scratch: Path) -> Mounts:
        paths: dict[str, Path] = {}
        for spec in service.get("volumes", []):
            assert isinstance(spec, str), f"use the short volume syntax: {spec!r}"
            source, target = spec.split(":")[:2]
            if source.startswith((".", "/")):
                paths[target] = (COMPOSE_DIR / source).resolve()
            else:  # a named volume: exists and is empty when the container starts
                host = scratch / source
                host.mkdir(exist_ok=True)
                paths[target] = host
        return cls(paths)

    def host(self, container_path: str) -> Path | None:
        for target, host in self.paths.items():
            if container_path == target:
                return host
            if container_path.startswith(target.rstrip("/") + "/"):
                return host / container_path[len(target.rstrip("/")) + 1 :]
        return None

    def translate(self, argv: list[str]) -> list[str]:
        out = []
        for arg in argv:
            host = self.host(arg) if arg.startswith("/") else None
            out.append(str(host) if host is not None else arg)
        return out


def parse_cli(argv: list[str]) -> tuple[str, click.Context]:
    """Parse `splitmq ARGV` exactly as the console script would, without running anything.

    Returns the leaf command's name and context; raises click.UsageError (NoSuchCommand,
    NoSuchOption, BadParameter, MissingParameter...) when the CLI does not accept `argv`.
    """
    ctx = click.Context(cli, info_name="splitmq", resilient_parsing=False)
    rest = click.Command.parse_args(cli, ctx, list(argv))  # the group's own options only
    assert rest, f"no subcommand in {argv!r}"
    name, cmd, args = cli.resolve_command(ctx, rest)
    assert name is not None and cmd is not None
    while True:
        sub = cmd.make_context(name, list(args), parent=ctx, resilient_parsing=False)
        if not isinstance(cmd, click.Group):
            return name, sub
        assert sub.args, f"{name} needs a subcommand in {argv!r}"
        ctx = sub
        name_or_none, next_cmd, args = cmd.resolve_command(ctx, sub.args)
        assert name_or_none is not None and next_cmd is not None
        name, cmd = name_or_none, next_cmd


def _our_image(service: Mapping[str, Any]) -> bool:
    build = service.get("build")
    return isinstance(build, dict) and str(build.get("dockerfile", "")).endswith("Dockerfile")


def role_services(compose: Mapping[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    for name, service in compose["services"].items():
        if _our_image(service):
            yield name, service


def healthcheck_argv(service: Mapping[str, Any]) -> list[str]:
    test = service["healthcheck"]["test"]
    assert isinstance(test, list) and test[0] == "CMD", f"exec-form healthcheck: {test!r}"
    return list(test[1:])


def service_settings(service: Mapping[str, Any]) -> Settings:
    """The settings a role container sees: the mounted job.toml plus the compose environment."""
    return load_settings(JOB_TOML, environment(service))


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return load_compose(BASE_FILE)


@pytest.fixture(scope="module")
def gpu() -> dict[str, Any]:
    return load_compose(GPU_FILE)


def test_required_services_are_defined(compose: dict[str, Any]) -> None:
    services = compose["services"]
    assert {"rabbitmq", "redis", *ROLES} <= set(services)
    assert {name for name, _ in role_services(compose)} == {*ROLES, AUTOSCALER, HOSTS}
    # One image for every role: the same tag and the same build (the autoscaler's own image,
    # with the Docker SDK, is checked below).
    roles = [service for name, service in role_services(compose) if name != AUTOSCALER]
    images = {service["image"] for service in roles}
    builds = {repr(service["build"]) for service in roles}
    assert len(images) == 1 and len(builds) == 1
    build = next(iter(role_services(compose)))[1]["build"]
    assert (COMPOSE_DIR / build["context"] / build["dockerfile"]).resolve() == DOCKERFILE


@pytest.mark.parametrize("role", ROLES)
def test_role_command_is_accepted_by_the_cli(
    compose: dict[str, Any], role: str, tmp_path: Path
) -> None:
    service = compose["services"][role]
    argv = service["command"]
    assert isinstance(argv, list) and argv[0] == role, f"{role}: command {argv!r}"
    mounts = Mounts.of(service, tmp_path)
    name, ctx = parse_cli(mounts.translate(argv))
    assert name == role
    # The CONFIG argument names the mounted compose/job.toml, not a path left unmounted.
    assert CONTAINER_CONFIG in argv
    assert mounts.host(CONTAINER_CONFIG) == JOB_TOML.resolve()
    config_values = [
        Path(value).resolve()
        for value in ctx.params.values()
        if isinstance(value, str | Path) and str(value).endswith(".toml")
    ]
    assert config_values == [JOB_TOML.resolve()]
    # Every other absolute path in the command lives on a mount (a report dir on a volume).
    for arg in argv:
        if arg.startswith("/"):
            assert mounts.host(arg) is not None, f"{role}: {arg} is not on a volume"


@pytest.mark.parametrize("role", [*ROLES, AUTOSCALER])
def test_role_healthcheck_is_accepted_by_the_cli(
    compose: dict[str, Any], role: str, tmp_path: Path
) -> None:
    service = compose["services"][role]
    argv = healthcheck_argv(service)
    assert argv[0] == "splitmq"
    name, _ = parse_cli(Mounts.of(service, tmp_path).translate(argv[1:]))
    assert name in cli.commands


@pytest.mark.parametrize("role", [*ROLES, AUTOSCALER])
def test_role_healthcheck_checks_that_role(compose: dict[str, Any], role: str) -> None:
    argv = healthcheck_argv(compose["services"][role])
    assert argv == ["splitmq", "--config", CONTAINER_CONFIG, "check", role]


def test_a_renamed_command_or_option_is_caught(tmp_path: Path) -> None:
    """The checker itself: it must reject what the real CLI would reject."""
    mounts = Mounts({CONTAINER_CONFIG: JOB_TOML.resolve()})
    with pytest.raises(click.UsageError):
        parse_cli(mounts.translate(["coordinatorr", CONTAINER_CONFIG]))
    with pytest.raises(click.UsageError):
        parse_cli(mounts.translate(["worker", CONTAINER_CONFIG, "--no-such-option"]))
    with pytest.raises(click.UsageError):
        # (A missing config file is not a usage error: it fails when the file is loaded,
        # with the same message in both forms; the healthchecks name the mounted file, above.)
        parse_cli(["doctor", CONTAINER_CONFIG, "unexpected-extra-argument"])


@pytest.mark.parametrize("role", ROLES)
def test_role_settings_use_the_compose_services(compose: dict[str, Any], role: str) -> None:
    service = compose["services"][role]
    settings = service_settings(service)
    assert settings.broker.kind == "rabbitmq"
    assert settings.store.kind == "redis"
    amqp = urlparse(settings.broker.amqp_url)
    redis = urlparse(settings.store.redis_url)
    assert (amqp.scheme, amqp.hostname, amqp.port) == ("amqp", "rabbitmq", 5672)
    assert (redis.scheme, redis.hostname, redis.port) == ("redis", "redis", 6379)
    # The broker's credentials are the ones the rabbitmq service creates.
    rabbit_env = environment(compose["services"]["rabbitmq"])
    assert amqp.username == rabbit_env["RABBITMQ_DEFAULT_USER"]
    assert amqp.password == rabbit_env["RABBITMQ_DEFAULT_PASS"]
    assert settings.clients.count == settings.clients.min_to_start == 4


def test_job_toml_alone_names_rabbitmq_and_redis() -> None:
    settings = load_settings(JOB_TOML, {})
    assert settings.broker.kind == "rabbitmq"
    assert urlparse(settings.broker.amqp_url).hostname == "rabbitmq"
    assert settings.store.kind == "redis"
    assert urlparse(settings.store.redis_url).hostname == "redis"


def test_client_hosts_run_clients_whose_partitions_the_coordinator_assigns(
    tmp_path: Path,
) -> None:
    env = {"SPLITMQ_CLIENTS": "1000", "SPLITMQ_CLIENTS_PER_HOST": "250"}
    service = load_compose(BASE_FILE, env)["services"][HOSTS]
    assert service["profiles"] == ["hosts"]
    argv = service["command"]
    name, ctx = parse_cli(Mounts.of(service, tmp_path).translate(argv))
    assert name == HOSTS
    assert ctx.params["count"] == 250 and ctx.params["partitions"] == "coordinator"
    assert healthcheck_argv(service) == ["splitmq", "--config", CONTAINER_CONFIG, "check", "client"]
    assert service_settings(service).clients.count == 1000


def test_client_count_follows_the_environment(compose: dict[str, Any]) -> None:
    scaled = load_compose(BASE_FILE, {"SPLITMQ_CLIENTS": "7"})
    client = scaled["services"]["client"]
    assert int(client["deploy"]["replicas"]) == 7
    settings = service_settings(client)
    assert settings.clients.count == settings.clients.min_to_start == 7
    default = compose["services"]["client"]
    assert int(default["deploy"]["replicas"]) == service_settings(default).clients.count


def test_broker_message_limit_matches_the_job() -> None:
    conf: dict[str, str] = {}
    for line in RABBITMQ_CONF.read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            key, value = line.split("=", 1)
            conf[key.strip()] = value.strip()
    assert int(conf["max_message_size"]) == 134217728
    assert load_settings(JOB_TOML, {}).broker.max_message_bytes == int(conf["max_message_size"])


@pytest.mark.parametrize("role", SCALED)
def test_scaled_roles_can_scale(compose: dict[str, Any], role: str) -> None:
    service = compose["services"][role]
    assert "container_name" not in service
    # A fixed hostname would also give every replica the same default member id.
    assert "hostname" not in service
    for port in service.get("ports", []):
        assert ":" not in str(port), f"{role} publishes a fixed host port: {port!r}"
    assert "--id" not in service["command"]


def test_startup_order_waits_for_healthy_services(compose: dict[str, Any]) -> None:
    services = compose["services"]
    for name, service in role_services(compose):
        depends = service["depends_on"]
        assert isinstance(depends, dict), f"{name}: depends_on needs conditions"
        assert "rabbitmq" in depends, name
        for target, spec in depends.items():
            assert spec["condition"] == "service_healthy", (name, target)
            assert "healthcheck" in services[target], f"{name} waits on {target}: no healthcheck"
    for name in ("coordinator", "aggregator", "worker"):
        assert "redis" in services[name]["depends_on"], name


def test_restart_policies(compose: dict[str, Any]) -> None:
    services = compose["services"]
    assert services["rabbitmq"]["restart"] == services["redis"]["restart"] == "unless-stopped"
    for name, service in role_services(compose):
        assert service["restart"] in ("on-failure", "unless-stopped"), name


def test_infrastructure_services(compose: dict[str, Any]) -> None:
    services = compose["services"]
    rabbitmq, redis = services["rabbitmq"], services["redis"]
    assert re.fullmatch(r"rabbitmq:3(\.\d+)*-management", rabbitmq["image"])
    assert rabbitmq["healthcheck"]["test"] == ["CMD", "rabbitmq-diagnostics", "-q", "ping"]
    conf_mounts = [v for v in rabbitmq["volumes"] if v.startswith("./rabbitmq.conf:")]
    assert len(conf_mounts) == 1
    assert conf_mounts[0].split(":")[1].startswith("/etc/rabbitmq/")

    assert re.fullmatch(r"redis:7(\.\d+)*", redis["image"])
    command = redis["command"]
    command = command.split() if isinstance(command, str) else command
    assert command[command.index("--appendonly") + 1] == "yes"
    # Acked checkpoints and announced versions must survive a crash (docs/reliability.md).
    assert command[command.index("--appendfsync") + 1] == "always"
    assert any(v.split(":")[0] in compose["volumes"] for v in redis["volumes"])
    assert redis["healthcheck"]["test"] == ["CMD", "redis-cli", "ping"]
    # Redis is internal (design §3): never published on the host.
    assert "ports" not in redis


def test_gpu_override_reserves_an_nvidia_device_for_the_worker(
    compose: dict[str, Any], gpu: dict[str, Any]
) -> None:
    assert set(gpu["services"]) <= set(compose["services"])
    worker = gpu["services"]["worker"]
    devices = worker["deploy"]["resources"]["reservations"]["devices"]
    assert devices == [{"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}]
    # Compose merges environment maps key by key: base environment plus the override.
    merged = {**environment(compose["services"]["worker"]), **environment(worker)}
    settings = load_settings(JOB_TOML, merged)
    assert settings.workers.device == "cuda"
    assert settings.broker.kind == "rabbitmq"
    # A CUDA build under its own tag: the CPU image of the other roles is not overwritten.
    assert "cu" in urlparse(worker["build"]["args"]["TORCH_INDEX_URL"]).path
    assert worker["image"] != compose["services"]["worker"]["image"]
    for name in gpu["services"]:
        assert "deploy" not in gpu["services"][name] or name == "worker"


def test_dockerfile() -> None:
    text = DOCKERFILE.read_text()
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    instructions = [line for line in lines if not line.startswith("#")]
    first_from = next(i for i, line in enumerate(instructions) if line.startswith("FROM "))
    assert "ARG BASE_IMAGE=python:3.11-slim" in instructions[:first_from]
    froms = [line for line in instructions if line.startswith("FROM ")]
    assert froms[0].startswith("FROM ${BASE_IMAGE}")
    assert len(froms) >= 3, "multi-stage: interpreter, builder, runtime"
    final = instructions[instructions.index(froms[-1]) :]
    assert not any(line.startswith("RUN pip") for line in final), "no building in the final stage"
    assert any("COPY --from=builder" in line for line in final)
    users = [line.split()[1] for line in final if line.startswith("USER ")]
    assert users and users[-1].split(":")[0] not in ("root", "0")
    assert 'ENTRYPOINT ["splitmq"]' in final
    # The image label names every role a compose service runs from it.
    label = re.search(r'image\.description="SplitMQ roles: ([^"]*)"', text)
    assert label is not None
    assert set(label.group(1).split(", ")) == {*ROLES, AUTOSCALER}
    # torch pinned, from the CPU index unless a build arg says otherwise.
    assert re.search(r'"torch==2\.13\.0"', text)
    assert "ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu" in instructions
    assert re.search(r'--index-url "\$\{TORCH_INDEX_URL\}"', text)
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "torch==2.13.0" in pyproject["project"]["dependencies"]


def test_dockerignore_keeps_what_the_build_needs() -> None:
    patterns = [
        line.strip()
        for line in DOCKERIGNORE.read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert ".git" in patterns and ".venv" in patterns
    needed = ["pyproject.toml", "broker", "services", "workers", "models"]
    needed += [str(p.relative_to(ROOT)) for p in (ROOT / "services/data/sample").glob("*.npz")]
    for path in needed:
        prefixes = [str(Path(*Path(path).parts[: i + 1])) for i in range(len(Path(path).parts))]
        for pattern in patterns:
            for candidate in prefixes:
                assert not _dockerignore_match(pattern, candidate), (pattern, path)


def _dockerignore_match(pattern: str, path: str) -> bool:
    """Docker's rule: patterns are anchored at the root; `**` spans directories."""
    regex = re.escape(pattern.lstrip("/")).replace(r"\*\*/", "(.*/)?").replace(r"\*", "[^/]*")
    regex = regex.replace(r"\?", "[^/]").replace(r"\[", "[").replace(r"\]", "]")
    return re.fullmatch(regex, path) is not None


# --- compose v1 compatibility, build arguments, the job file --------------------------------

HOSTNET_FILE = COMPOSE_DIR / "docker-compose.hostnet.yml"
HOSTNET_RABBITMQ_CONF = COMPOSE_DIR / "hostnet-rabbitmq.conf"
SMOKE_SH = COMPOSE_DIR / "smoke.sh"
SMOKE_TOML = COMPOSE_DIR / "smoke.toml"
LOCAL_IMAGES = COMPOSE_DIR / "local-images"


def merge(base: Mapping[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    """Compose's merge for what these files override: mappings key by key, volumes added
    (by container path), the rest replaced."""
    out = dict(base)
    for key, value in override.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = merge(out[key], value)
        elif key == "volumes" and isinstance(value, list):
            targets = {spec.split(":")[1] for spec in value}
            kept = [spec for spec in out.get(key, []) if spec.split(":")[1] not in targets]
            out[key] = kept + value
        else:
            out[key] = value
    return out


def conf_values(path: Path) -> dict[str, str]:
    pairs = (
        line.split("=", 1)
        for line in path.read_text().splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    )
    return {key.strip(): value.strip() for key, value in pairs}


def dockerfile_args(text: str) -> set[str]:
    return {m.group(1) for m in re.finditer(r"^ARG ([A-Z_]+)", text, re.MULTILINE)}


def test_files_stay_within_what_compose_v1_accepts() -> None:
    """Debian's docker-compose 1.29 (compose/smoke.sh) rejects these Compose v2 additions."""
    for path in (BASE_FILE, GPU_FILE, HOSTNET_FILE):
        data = yaml.safe_load(path.read_text())
        assert "name" not in data, f"{path.name}: top-level name (use -p)"
        for name, service in data["services"].items():
            if isinstance(service, dict):
                assert "start_interval" not in service.get("healthcheck", {}), (path.name, name)
    anchor = yaml.safe_load(BASE_FILE.read_text())["x-role"]["healthcheck"]
    assert "start_interval" not in anchor


def test_every_build_argument_is_declared_by_the_dockerfile(compose: dict[str, Any]) -> None:
    declared = dockerfile_args(DOCKERFILE.read_text())
    for _, service in role_services(compose):
        assert set(service["build"]["args"]) <= declared
    assert set(load_compose(GPU_FILE)["services"]["worker"]["build"]["args"]) <= declared
    assert {"BASE_IMAGE", "TORCH_INDEX_URL", "PIP_INDEX_URL", "EXTRAS"} <= declared


def test_dockerfile_works_without_a_registry_and_ships_no_installer() -> None:
    text = DOCKERFILE.read_text()
    # BuildKit would pull a `# syntax=` frontend from a registry.
    assert not re.search(r"^#\s*syntax\s*=", text, re.MULTILINE)
    instructions = [line.strip() for line in text.splitlines() if line.strip()]
    builder = instructions[instructions.index("FROM interpreter AS builder") :]
    end = next(i for i, line in enumerate(builder) if i > 0 and line.startswith("FROM "))
    builder = builder[:end]
    assert any("pip uninstall --yes pip setuptools wheel" in line for line in builder)
    # The extras go into the one `pip install` of the project.
    assert any('pip install "/src${EXTRAS:+[$EXTRAS]}"' in line for line in builder)


def test_the_job_file_follows_the_environment(tmp_path: Path) -> None:
    smoke = load_compose(BASE_FILE, {"SPLITMQ_JOB_FILE": "./smoke.toml", "SPLITMQ_CLIENTS": "3"})
    for role in ROLES:
        service = smoke["services"][role]
        mounts = Mounts.of(service, tmp_path)
        assert mounts.host(CONTAINER_CONFIG) == SMOKE_TOML.resolve(), role
        name, _ = parse_cli(mounts.translate(service["command"]))
        assert name == role
        settings = load_settings(SMOKE_TOML, environment(service))
        assert settings.clients.count == settings.clients.min_to_start == 3


def test_health_intervals_follow_the_environment() -> None:
    tuned = load_compose(
        BASE_FILE, {"SPLITMQ_HEALTH_INTERVAL": "15s", "SPLITMQ_CLIENT_HEALTH_INTERVAL": "60s"}
    )
    services = tuned["services"]
    steady = [r for r in (*ROLES, AUTOSCALER) if r != "client"]
    assert {services[r]["healthcheck"]["interval"] for r in steady} == {"15s"}
    assert services["client"]["healthcheck"]["interval"] == "60s"
    for role in (*ROLES, AUTOSCALER):
        assert re.fullmatch(r"\d+(ms|s|m|h)", services[role]["healthcheck"]["timeout"]), role


def test_infrastructure_images_can_be_replaced(compose: dict[str, Any]) -> None:
    local = load_compose(
        BASE_FILE,
        {"SPLITMQ_RABBITMQ_IMAGE": "local/rabbitmq", "SPLITMQ_REDIS_IMAGE": "local/redis"},
    )
    assert local["services"]["rabbitmq"]["image"] == "local/rabbitmq"
    assert local["services"]["redis"]["image"] == "local/redis"


# --- host networking (compose/docker-compose.hostnet.yml) -------------------------------------


@pytest.fixture(scope="module")
def hostnet(compose: dict[str, Any]) -> dict[str, Any]:
    override = load_compose(HOSTNET_FILE)
    services = {
        name: merge(compose["services"][name], override["services"].get(name, {}))
        for name in compose["services"]
    }
    return {"services": services, "override": override}


def test_hostnet_puts_every_service_on_the_host_network(hostnet: dict[str, Any]) -> None:
    assert set(hostnet["override"]["services"]) == set(hostnet["services"])
    for name, service in hostnet["services"].items():
        assert service["network_mode"] == "host", name
    for name, service in role_services(hostnet):
        assert service["build"]["network"] == "host", name


@pytest.mark.parametrize("role", ROLES)
def test_hostnet_roles_reach_the_stacks_own_rabbitmq_and_redis(
    hostnet: dict[str, Any], role: str, tmp_path: Path
) -> None:
    services = hostnet["services"]
    service = services[role]
    settings = service_settings(service)
    amqp = urlparse(settings.broker.amqp_url)
    redis = urlparse(settings.store.redis_url)
    # The AMQP listener of hostnet-rabbitmq.conf, off the host's own 5672.
    listener = conf_values(HOSTNET_RABBITMQ_CONF)["listeners.tcp.default"]
    assert f"{amqp.hostname}:{amqp.port}" == listener
    assert amqp.port != 5672
    rabbit_env = environment(services["rabbitmq"])
    assert (amqp.username, amqp.password) == (
        rabbit_env["RABBITMQ_DEFAULT_USER"],
        rabbit_env["RABBITMQ_DEFAULT_PASS"],
    )
    # Redis: the port its command listens on and its healthcheck pings, off the host's 6379.
    command = services["redis"]["command"]
    port = int(command[command.index("--port") + 1])
    assert (redis.hostname, redis.port) == ("127.0.0.1", port) and port != 6379
    assert command[command.index("--appendonly") + 1] == "yes"
    assert command[command.index("--appendfsync") + 1] == "always"
    assert services["redis"]["healthcheck"]["test"] == ["CMD", "redis-cli", "-p", str(port), "ping"]
    # The merged service still runs a command the CLI accepts.
    name, _ = parse_cli(Mounts.of(service, tmp_path).translate(service["command"]))
    assert name == role


def test_hostnet_rabbitmq_keeps_off_the_hosts_erlang_ports(hostnet: dict[str, Any]) -> None:
    rabbitmq = hostnet["services"]["rabbitmq"]
    env = environment(rabbitmq)
    assert int(env["ERL_EPMD_PORT"]) != 4369
    assert int(env["RABBITMQ_DIST_PORT"]) != 25672
    conf = conf_values(HOSTNET_RABBITMQ_CONF)
    assert int(conf["management.tcp.port"]) != 15672
    assert conf["management.tcp.ip"] == "127.0.0.1"
    mounted = [v.split(":") for v in rabbitmq["volumes"] if v.startswith("./hostnet-rabbitmq")]
    assert len(mounted) == 1 and mounted[0][1].startswith("/etc/rabbitmq/conf.d/")
    # conf.d files load in name order: this one after the image's defaults and rabbitmq.conf.
    base_conf = next(v.split(":")[1] for v in rabbitmq["volumes"] if v.startswith("./rabbitmq."))
    assert Path(mounted[0][1]).name > Path(base_conf).name


# --- compose/smoke.sh and its job --------------------------------------------------------------


def smoke_settings() -> dict[str, str]:
    """The NAME=value assignments at the top level of smoke.sh."""
    found = re.findall(r"^([A-Z_]+)=([^\s$]+)$", SMOKE_SH.read_text(), re.MULTILINE)
    return dict(found)


def test_smoke_script_matches_its_job_and_the_hostnet_file(hostnet: dict[str, Any]) -> None:
    script = smoke_settings()
    settings = load_settings(SMOKE_TOML, {})
    assert script["JOB"] == settings.job.name
    assert int(script["CLIENTS"]) == settings.clients.count == settings.clients.min_to_start
    # Scaling 2 -> 3 -> 1 means something only when every worker can hold a shard.
    assert settings.shards >= int(script["WORKERS_UP"]) > int(script["WORKERS"])
    assert int(script["WORKERS_DOWN"]) < int(script["WORKERS"])
    redis_env = environment(hostnet["services"]["worker"])
    assert urlparse(redis_env["SPLITMQ_REDIS_URL"]).port == int(script["REDIS_PORT"])
    # Enough rounds to wait for 2 versions, then train with 3 workers and with 1.
    assert settings.job.rounds >= 5
    assert settings.data.dataset == "fashion_mnist_sample" and settings.model.name == "cnn5"


def test_smoke_script_tears_down_on_any_exit() -> None:
    text = SMOKE_SH.read_text()
    assert text.startswith("#!/usr/bin/env bash\n")
    assert "set -Eeuo pipefail" in text
    assert re.search(r"^\s*trap finish EXIT$", text, re.MULTILINE)
    # The work runs in a function, so bash parses the whole file before it starts.
    assert text.rstrip().endswith('main "$@"; exit')
    finish = text[text.index("finish() {") : text.index("trap finish EXIT")]
    assert "down -v" in finish
    assert SMOKE_SH.stat().st_mode & 0o111, "smoke.sh is not executable"
    # Every compose file the script names exists.
    for name in re.findall(r"\$HERE/([\w./-]+\.(?:yml|Dockerfile))", text):
        assert (COMPOSE_DIR / name).exists(), name


def test_local_images_run_as_non_root() -> None:
    for name in ("rabbitmq", "redis"):
        text = (LOCAL_IMAGES / f"{name}.Dockerfile").read_text()
        assert re.search(r"^ARG BASE_IMAGE=", text, re.MULTILINE)
        users = re.findall(r"^USER (\S+)", text, re.MULTILINE)
        assert users and users[-1] not in ("root", "0"), name
    entrypoint = LOCAL_IMAGES / "rabbitmq-entrypoint.sh"
    assert entrypoint.stat().st_mode & 0o111
    assert "RABBITMQ_DEFAULT_USER" in entrypoint.read_text()


# --- member ids under host networking -------------------------------------------------------


def test_default_member_ids_differ_where_hostname_and_pid_are_shared(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Containers on network_mode: host share the hostname, and `init: true` gives each role
    the same small pid: the default ids of two such workers must still differ."""
    import os
    import socket

    from services.cli.common import default_member_id

    monkeypatch.setattr(socket, "gethostname", lambda: "vm.example")
    monkeypatch.setattr(os, "getpid", lambda: 7)
    ids = {default_member_id("worker-") for _ in range(50)}
    assert len(ids) == 50
    for member in ids:
        assert re.fullmatch(r"worker-vm-7-[0-9a-f]{6}", member), member


def test_smoke_script_reads_the_stores_real_keys() -> None:
    """smoke.sh reads versions, members, checkpoints and leases with redis-cli: by the key
    names broker/keys.py builds, so a renamed key fails here, not in a manual run."""
    from broker import keys
    from broker.store import MemberKind
    from services.common.leases import lease_name

    used = set(re.findall(r'"(splitmq:\$JOB:[^"]+)"', SMOKE_SH.read_text()))
    rendered = {key.replace("$JOB", "J").replace("$s", "0").replace("$1", "worker") for key in used}
    assert rendered == {
        keys.version_key("J"),
        keys.members_key("J", MemberKind.WORKER),
        keys.checkpoint_key("J", 0),
        keys.lease_key("J", lease_name(0)),
    }


@pytest.mark.parametrize("role", ROLES)
def test_role_subcommands_answer_help(compose: dict[str, Any], role: str) -> None:
    """The subcommands the containers run exist in the installed CLI: `--help` exits 0 and
    shows their usage (the parse tests above check the arguments themselves)."""
    from click.testing import CliRunner

    service = compose["services"][role]
    for argv in (service["command"], healthcheck_argv(service)[1:]):
        # The first word that is neither an option nor a path (the config) is the subcommand.
        subcommand = next(a for a in argv if not a.startswith(("-", "/")))
        result = CliRunner().invoke(cli, [subcommand, "--help"], prog_name="splitmq")
        assert result.exit_code == 0, (argv, result.output)
        assert f"Usage: splitmq {subcommand} " in result.output


# --- the autoscaler service (--profile autoscale) ---------------------------------------------


def test_autoscaler_command_is_accepted_by_the_cli(compose: dict[str, Any], tmp_path: Path) -> None:
    service = compose["services"][AUTOSCALER]
    argv = service["command"]
    assert argv == ["autoscale", CONTAINER_CONFIG]
    mounts = Mounts.of(service, tmp_path)
    name, ctx = parse_cli(mounts.translate(argv))
    assert name == "autoscale"
    assert mounts.host(CONTAINER_CONFIG) == JOB_TOML.resolve()
    assert [Path(v).resolve() for v in ctx.params.values() if isinstance(v, Path)] == [
        JOB_TOML.resolve()
    ]
    # It copies running worker containers, so it waits for a healthy worker.
    assert service["depends_on"]["worker"]["condition"] == "service_healthy"


def test_autoscaler_and_hosts_are_off_unless_their_profiles_are_enabled(
    compose: dict[str, Any],
) -> None:
    assert compose["services"][AUTOSCALER]["profiles"] == ["autoscale"]
    assert compose["services"][HOSTS]["profiles"] == ["hosts"]
    for name, service in compose["services"].items():
        assert name in (AUTOSCALER, HOSTS) or "profiles" not in service, name


def test_autoscaler_sizes_this_projects_worker_service(compose: dict[str, Any]) -> None:
    service = compose["services"][AUTOSCALER]
    settings = service_settings(service)
    section = settings.autoscaler
    assert section.backend == "docker"
    assert section.docker_service == "worker" and "worker" in compose["services"]
    assert section.docker_project == "splitmq"  # the project the docs start
    named = load_compose(BASE_FILE, {"COMPOSE_PROJECT_NAME": "team-a"})
    assert service_settings(named["services"][AUTOSCALER]).autoscaler.docker_project == "team-a"
    # The same broker, store and job as the workers it sizes.
    worker = service_settings(compose["services"]["worker"])
    assert settings.broker == worker.broker and settings.store == worker.store
    assert settings.job.name == worker.job.name


def test_autoscaler_reaches_the_docker_socket(compose: dict[str, Any]) -> None:
    service = compose["services"][AUTOSCALER]
    assert "/var/run/docker.sock:/var/run/docker.sock" in service["volumes"]
    # The socket is root:docker 660: root unless told the socket's group.
    assert service["user"] == "root"
    tuned = load_compose(BASE_FILE, {"SPLITMQ_AUTOSCALER_USER": "10001:998"})
    assert tuned["services"][AUTOSCALER]["user"] == "10001:998"
    # No other service gets the socket.
    for name, other in compose["services"].items():
        if name != AUTOSCALER:
            assert not any("docker.sock" in str(v) for v in other.get("volumes", [])), name


def test_autoscaler_image_adds_the_docker_sdk_to_the_roles_build(compose: dict[str, Any]) -> None:
    service = compose["services"][AUTOSCALER]
    worker = compose["services"]["worker"]
    args = service["build"]["args"]
    assert args["EXTRAS"] == "docker"
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert any(
        d.startswith("docker") for d in pyproject["project"]["optional-dependencies"]["docker"]
    )
    # Otherwise the roles' build, so the torch layers are shared, under a tag of its own.
    assert {k: v for k, v in args.items() if k != "EXTRAS"} == {
        k: v for k, v in worker["build"]["args"].items() if k != "EXTRAS"
    }
    assert {k: v for k, v in service["build"].items() if k != "args"} == {
        k: v for k, v in worker["build"].items() if k != "args"
    }
    assert service["image"] == f"{worker['image']}-autoscaler"
    # The extra is declared after the torch layers (an ARG changes every later RUN's cache key).
    lines = [line.strip() for line in DOCKERFILE.read_text().splitlines()]
    assert lines.index('ARG EXTRAS=""') > next(
        i for i, line in enumerate(lines) if line.startswith("RUN pip install --index-url")
    )


def test_autoscaler_subcommand_answers_help() -> None:
    from click.testing import CliRunner

    result = CliRunner().invoke(cli, ["autoscale", "--help"], prog_name="splitmq")
    assert result.exit_code == 0, result.output
    assert "Usage: splitmq autoscale " in result.output


def test_hostnet_autoscaler_reaches_the_stacks_own_rabbitmq_and_redis(
    hostnet: dict[str, Any], tmp_path: Path
) -> None:
    services = hostnet["services"]
    autoscaler = service_settings(services[AUTOSCALER])
    worker = service_settings(services["worker"])
    assert autoscaler.broker.amqp_url == worker.broker.amqp_url
    assert autoscaler.store.redis_url == worker.store.redis_url
    assert urlparse(autoscaler.broker.amqp_url).port != 5672
    assert services[AUTOSCALER]["network_mode"] == "host"
    name, _ = parse_cli(
        Mounts.of(services[AUTOSCALER], tmp_path).translate(["autoscale", CONTAINER_CONFIG])
    )
    assert name == "autoscale"


def test_smoke_autoscaler_settings_match_the_script() -> None:
    script = smoke_settings()
    settings = load_settings(SMOKE_TOML, {})
    section = settings.autoscaler
    assert section.backend == "docker"
    assert section.docker_project == script["PROJECT"]
    # The script exports the project name, which the compose file hands to the autoscaler.
    assert "export COMPOSE_PROJECT_NAME=$PROJECT" in SMOKE_SH.read_text()
    assert (section.min_workers, section.max_workers) == (
        int(script["AUTOSCALE_MIN"]),
        int(script["AUTOSCALE_MAX"]),
    )
    # The maximum is reachable (the autoscaler never runs more workers than shards) and is
    # more than the minimum, or the phase would show nothing.
    assert section.min_workers < section.max_workers <= settings.shards
    assert script["EXTRAS"] == "docker"
    # Short enough for a phase of minutes: hand-over within a lease, quick decisions.
    assert settings.workers.lease_ttl_s <= 10
    assert section.cooldown_s <= 10 and section.scale_down_after_s <= 30
