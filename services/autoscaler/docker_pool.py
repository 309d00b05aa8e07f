"""Workers as containers of a compose project's `worker` service, through the Docker SDK
(docs/deployment.md, "Backends": how a new worker copies the newest one, how one is stopped).

A new worker's command gets `--id <name>`, so its store member is known even where containers
share a hostname (`network_mode: host`); scaling down never follows SIGTERM with SIGKILL.
`docker` is imported only when a client is made, so nothing else needs it; tests pass a fake.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Mapping, Sequence
from typing import Any

from services.autoscaler.pool import Exited, PoolWorker

PROJECT_LABEL = "com.docker.compose.project"
SERVICE_LABEL = "com.docker.compose.service"
NUMBER_LABEL = "com.docker.compose.container-number"
ONEOFF_LABEL = "com.docker.compose.oneoff"
SCALED_LABEL = "io.splitmq.autoscaled"
_UP = ("created", "running", "restarting")
_DOWN = ("exited", "dead")


class DockerUnavailableError(RuntimeError):
    """No SDK, no daemon, or nothing to copy a worker from."""


def docker_client() -> Any:
    """`docker.from_env()`: DOCKER_HOST, or the local socket."""
    try:
        docker = importlib.import_module("docker")
    except ImportError:
        raise DockerUnavailableError(
            "the Docker backend needs the Docker SDK: pip install 'splitmq[docker]'"
        ) from None
    try:
        return docker.from_env()
    except Exception as exc:  # docker.errors.DockerException, without importing it
        raise DockerUnavailableError(f"cannot reach the Docker daemon: {exc}") from exc


def _number(container: Any) -> int:
    try:
        return int(container.labels.get(NUMBER_LABEL, "0"))
    except ValueError:
        return 0


def _split_id(command: Sequence[str] | None) -> tuple[str | None, list[str]]:
    """The command's `--id` value (None without one) and the command without that option."""
    given, rest, args = None, [], iter(command or [])
    for arg in args:
        if arg == "--id":
            given = next(args, None)
        else:
            rest.append(arg)
    return given, rest


def worker_key(container: Any) -> str:
    """Its worker id (`--id`), else the prefix of the CLI's default `worker-<hostname>-<pid>`."""
    config = container.attrs.get("Config", {})
    given, _ = _split_id(config.get("Cmd"))
    return given or f"worker-{config.get('Hostname') or container.name}"


def _device_requests(raw: Sequence[Mapping[str, Any]] | None) -> list[dict[str, Any]] | None:
    if not raw:
        return None
    # The SDK wants its own (lowercase) keyword names, inspect gives the API's.
    return [
        {
            "driver": r.get("Driver", ""),
            "count": r.get("Count", 0),
            "device_ids": r.get("DeviceIDs") or [],
            "capabilities": r.get("Capabilities") or [],
            "options": r.get("Options") or {},
        }
        for r in raw
    ]


def clone_arguments(template: Any, name: str, number: int) -> dict[str, Any]:
    """`containers.run` keywords for a copy of `template` named `name`."""
    attrs = template.attrs
    config, host = attrs.get("Config", {}), attrs.get("HostConfig", {})
    labels = {**(config.get("Labels") or {}), NUMBER_LABEL: str(number), SCALED_LABEL: "true"}
    kwargs: dict[str, Any] = {
        "image": config.get("Image"),
        "command": [*_split_id(config.get("Cmd"))[1], "--id", name],
        "name": name,
        "detach": True,
        "environment": list(config.get("Env") or []),
        "labels": labels,
        "restart_policy": host.get("RestartPolicy") or None,
    }
    optional = {
        "entrypoint": config.get("Entrypoint"),
        "user": config.get("User") or None,
        "working_dir": config.get("WorkingDir") or None,
        "healthcheck": config.get("Healthcheck"),
        "init": host.get("Init"),
        "volumes": host.get("Binds") or None,
        "mounts": host.get("Mounts") or None,
        "device_requests": _device_requests(host.get("DeviceRequests")),
    }
    kwargs.update({k: v for k, v in optional.items() if v is not None})
    mode = str(host.get("NetworkMode") or "")
    if mode in ("host", "none") or mode.startswith("container:"):
        kwargs["network_mode"] = mode
    else:
        networks = list((attrs.get("NetworkSettings") or {}).get("Networks") or {})
        if networks:
            kwargs["network"] = networks[0]
    return kwargs


class DockerPool:
    """`WorkerPool` over the containers of `project`'s `service`."""

    def __init__(self, client: Any, project: str, service: str = "worker") -> None:
        self._client = client
        self._project = project
        self._service = service
        self._log = logging.getLogger("splitmq.autoscaler")
        self._stopping: set[str] = set()

    def _containers(self) -> list[Any]:
        labels = [f"{PROJECT_LABEL}={self._project}", f"{SERVICE_LABEL}={self._service}"]
        found = self._client.containers.list(all=True, filters={"label": labels})
        # `docker compose run worker ...` (e.g. the autoscaler itself) is no worker of the pool.
        kept = [c for c in found if c.labels.get(ONEOFF_LABEL, "False") != "True"]
        return sorted(kept, key=_number)

    def workers(self) -> list[PoolWorker]:
        return [
            PoolWorker(c.name, worker_key(c), stopping=c.name in self._stopping)
            for c in self._containers()
            if c.status in _UP or c.name in self._stopping
        ]

    def start_worker(self) -> PoolWorker:
        containers = self._containers()
        if not containers:
            raise DockerUnavailableError(
                f"no container of service {self._service!r} in compose project "
                f"{self._project!r} to copy: start the stack with at least one worker"
            )
        template = containers[-1]
        number = _number(template) + 1
        name = f"{self._project}-{self._service}-{number}"
        container = self._client.containers.run(**clone_arguments(template, name, number))
        return PoolWorker(container.name, name)

    def stop_worker(self, name: str) -> None:
        container = self._find(name)
        if container is None or name in self._stopping:
            return
        # on-failure would bring back a worker that exits non-zero while handing over.
        container.update(restart_policy={"Name": "no"})
        container.kill(signal="SIGTERM")
        self._stopping.add(name)

    def reap(self) -> list[Exited]:
        gone = []
        for name in sorted(self._stopping):
            container = self._find(name)
            if container is None:
                gone.append(Exited(name, None))
                continue
            container.reload()
            if container.status not in _DOWN:
                continue
            code = container.attrs.get("State", {}).get("ExitCode")
            container.remove()
            gone.append(Exited(name, None if code is None else int(code)))
        for exited in gone:
            self._stopping.discard(exited.name)
        return gone

    def close(self) -> None:
        """The containers stay: they belong to the compose project, not to us."""
        self._client.close()

    def _find(self, name: str) -> Any | None:
        return next((c for c in self._containers() if c.name == name), None)
