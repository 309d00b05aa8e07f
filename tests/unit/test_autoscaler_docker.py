"""The Docker backend against a fake Docker SDK client (the real one is the smoke test's)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pytest

from services.autoscaler.docker_pool import (
    NUMBER_LABEL,
    ONEOFF_LABEL,
    PROJECT_LABEL,
    SCALED_LABEL,
    SERVICE_LABEL,
    DockerPool,
    DockerUnavailableError,
)


class FakeContainer:
    def __init__(self, name: str, labels: Mapping[str, str], attrs: dict[str, Any]) -> None:
        self.name = name
        self.labels = dict(labels)
        self.attrs = attrs
        self.status = "running"
        self.signals: list[str] = []
        self.updates: list[dict[str, Any]] = []
        self.removed = False
        self.reloads = 0

    def kill(self, signal: str | None = None) -> None:
        self.signals.append(str(signal))

    def update(self, **kwargs: Any) -> None:
        self.updates.append(kwargs)

    def reload(self) -> None:
        self.reloads += 1

    def remove(self) -> None:
        assert self.status in ("exited", "dead"), "removed a running container"
        self.removed = True

    def exit(self, code: int) -> None:
        """What the worker does on SIGTERM, some time later."""
        self.status = "exited"
        self.attrs["State"] = {"ExitCode": code}


class FakeContainers:
    def __init__(self) -> None:
        self.all: list[FakeContainer] = []
        self.runs: list[dict[str, Any]] = []

    def list(self, all: bool = False, filters: Mapping[str, Any] | None = None) -> list[Any]:
        wanted = dict(label.split("=", 1) for label in (filters or {}).get("label", []))
        return [
            c
            for c in self.all
            if not c.removed and (all or c.status == "running") and all_items_in(wanted, c.labels)
        ]

    def run(self, **kwargs: Any) -> FakeContainer:
        self.runs.append(kwargs)
        attrs = {"Config": {"Cmd": kwargs["command"], "Hostname": "cafe"}, "HostConfig": {}}
        container = FakeContainer(kwargs["name"], kwargs["labels"], attrs)
        self.all.append(container)
        return container


def all_items_in(wanted: Mapping[str, str], labels: Mapping[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in wanted.items())


class FakeClient:
    def __init__(self) -> None:
        self.containers = FakeContainers()
        self.closed = False

    def close(self) -> None:
        self.closed = True


def compose_worker(
    number: int, *, project: str = "splitmq", network: str = "host"
) -> FakeContainer:
    labels = {
        PROJECT_LABEL: project,
        SERVICE_LABEL: "worker",
        NUMBER_LABEL: str(number),
        "com.docker.compose.config-hash": "abc",
    }
    attrs: dict[str, Any] = {
        "Config": {
            "Image": "splitmq:latest",
            "Cmd": ["worker", "/etc/splitmq/job.toml"],
            "Env": ["SPLITMQ_BROKER=rabbitmq", "SPLITMQ_STORE=redis"],
            "Labels": labels,
            "Hostname": f"host{number}",
            "Healthcheck": {"Test": ["CMD", "splitmq", "check", "worker"], "Interval": 10**10},
        },
        "HostConfig": {
            "Init": True,
            "RestartPolicy": {"Name": "on-failure", "MaximumRetryCount": 0},
            "NetworkMode": network,
            "Binds": ["/srv/job.toml:/etc/splitmq/job.toml:ro"],
            "DeviceRequests": [
                {"Driver": "nvidia", "Count": -1, "Capabilities": [["gpu"]], "DeviceIDs": None}
            ],
        },
        "NetworkSettings": {"Networks": {"splitmq_default": {}}},
    }
    return FakeContainer(f"{project}-worker-{number}", labels, attrs)


@pytest.fixture
def client() -> FakeClient:
    fake = FakeClient()
    fake.containers.all += [compose_worker(1), compose_worker(2)]
    # Another project's worker and this project's client: not ours to count or copy.
    fake.containers.all.append(compose_worker(9, project="other"))
    other = compose_worker(3)
    other.labels[SERVICE_LABEL] = "client"
    fake.containers.all.append(other)
    # `docker compose run worker autoscale ...`: the worker service's image, but no worker.
    oneoff = compose_worker(4)
    oneoff.labels[ONEOFF_LABEL] = "True"
    fake.containers.all.append(oneoff)
    return fake


def test_workers_are_the_projects_worker_containers_keyed_by_their_worker_id(
    client: FakeClient,
) -> None:
    pool = DockerPool(client, "splitmq")
    workers = pool.workers()
    assert [w.name for w in workers] == ["splitmq-worker-1", "splitmq-worker-2"]
    # The CLI's default id is worker-<hostname>-<pid>.
    assert workers[0].key == "worker-host1"
    assert workers[0].owns("worker-host1-7") and not workers[0].owns("worker-host10-7")
    client.containers.all[0].status = "exited"  # crashed; not counted while it is down
    assert [w.name for w in pool.workers()] == ["splitmq-worker-2"]


def test_a_new_worker_copies_the_newest_with_the_next_number_and_its_own_id(
    client: FakeClient,
) -> None:
    pool = DockerPool(client, "splitmq")
    started = pool.start_worker()
    assert started.name == "splitmq-worker-3" and started.key == "splitmq-worker-3"
    (run,) = client.containers.runs
    assert run["image"] == "splitmq:latest" and run["detach"] is True
    assert run["command"] == ["worker", "/etc/splitmq/job.toml", "--id", "splitmq-worker-3"]
    assert run["environment"] == ["SPLITMQ_BROKER=rabbitmq", "SPLITMQ_STORE=redis"]
    assert run["labels"][NUMBER_LABEL] == "3" and run["labels"][SCALED_LABEL] == "true"
    assert run["labels"]["com.docker.compose.config-hash"] == "abc"  # compose owns it too
    assert run["network_mode"] == "host" and "network" not in run
    assert run["init"] is True and run["volumes"] == ["/srv/job.toml:/etc/splitmq/job.toml:ro"]
    assert run["restart_policy"] == {"Name": "on-failure", "MaximumRetryCount": 0}
    assert run["device_requests"] == [
        {
            "driver": "nvidia",
            "count": -1,
            "device_ids": [],
            "capabilities": [["gpu"]],
            "options": {},
        }
    ]
    assert run["healthcheck"]["Test"] == ["CMD", "splitmq", "check", "worker"]
    assert [w.name for w in pool.workers()][-1] == "splitmq-worker-3"
    # A copy of a copy does not stack ids.
    pool.start_worker()
    assert client.containers.runs[1]["command"][-2:] == ["--id", "splitmq-worker-4"]
    assert client.containers.runs[1]["command"].count("--id") == 1


def test_a_bridge_networked_worker_is_copied_onto_its_network() -> None:
    fake = FakeClient()
    fake.containers.all.append(compose_worker(1, network="splitmq_default"))
    DockerPool(fake, "splitmq").start_worker()
    (run,) = fake.containers.runs
    assert run["network"] == "splitmq_default" and "network_mode" not in run


def test_scaling_down_sends_sigterm_only_and_removes_the_container_once_it_exited(
    client: FakeClient,
) -> None:
    pool = DockerPool(client, "splitmq")
    victim = client.containers.all[1]
    pool.stop_worker("splitmq-worker-2")
    pool.stop_worker("splitmq-worker-2")  # asking twice signals once
    assert victim.signals == ["SIGTERM"]
    assert victim.updates == [{"restart_policy": {"Name": "no"}}]
    stopping = {w.name: w.stopping for w in pool.workers()}
    assert stopping == {"splitmq-worker-1": False, "splitmq-worker-2": True}
    # Handing over takes a while: nothing is reaped, nothing killed, nothing removed.
    assert pool.reap() == [] and not victim.removed
    victim.exit(0)
    (exited,) = pool.reap()
    assert (exited.name, exited.code) == ("splitmq-worker-2", 0)
    assert victim.removed and victim.signals == ["SIGTERM"]
    assert [w.name for w in pool.workers()] == ["splitmq-worker-1"]
    assert pool.reap() == []


def test_a_stopping_container_removed_by_someone_else_is_reaped_with_no_code(
    client: FakeClient,
) -> None:
    pool = DockerPool(client, "splitmq")
    pool.stop_worker("splitmq-worker-1")
    client.containers.all[0].status = "exited"
    client.containers.all[0].removed = True
    (exited,) = pool.reap()
    assert (exited.name, exited.code) == ("splitmq-worker-1", None)


def test_without_a_worker_to_copy_starting_one_says_what_to_do() -> None:
    with pytest.raises(DockerUnavailableError, match="at least one worker"):
        DockerPool(FakeClient(), "splitmq").start_worker()


def test_close_leaves_the_containers_running(client: FakeClient) -> None:
    pool = DockerPool(client, "splitmq")
    pool.close()
    assert client.closed
    assert all(c.signals == [] for c in client.containers.all)
