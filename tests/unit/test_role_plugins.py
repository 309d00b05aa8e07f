"""The worker reaches the runtime through its entry points (services/runtime/plugins.py): the
installed ones load and fit their protocols, and a missing or wrong one says what to do."""

from __future__ import annotations

from collections.abc import Callable
from importlib.metadata import EntryPoint, EntryPoints

import pytest

from services.common.backends import Backends, Embedded
from services.config.root import Settings
from services.runtime import plugins
from services.runtime.plugins import (
    ROLE_GROUP,
    InferenceFactory,
    RolePluginError,
    WorkerFactory,
    inference_factory,
    worker_factory,
)
from services.runtime.roles import build_worker
from workers.role import INFER, WORKER
from workers.worker import Worker


def registered(*points: tuple[str, str]) -> EntryPoints:
    return EntryPoints(EntryPoint(name, value, ROLE_GROUP) for name, value in points)


def only(found: EntryPoints) -> Callable[..., EntryPoints]:
    """What `entry_points(group=..., name=...)` answers when only `found` is installed."""

    def entry_points(*, group: str, name: str) -> EntryPoints:
        return found.select(group=group, name=name)

    return entry_points


def test_the_installed_entry_points_are_the_worker_packages() -> None:
    assert worker_factory() is WORKER
    assert inference_factory() is INFER
    assert isinstance(WORKER, WorkerFactory)
    assert isinstance(INFER, InferenceFactory)


def test_build_worker_builds_the_worker_through_its_entry_point() -> None:
    settings = Settings()
    backends = Backends(settings.broker, settings.store, Embedded())
    role = build_worker(settings, backends, worker_id="w7")
    assert isinstance(role, Worker)
    assert role.worker_id == "w7"


def test_a_missing_entry_point_says_to_reinstall(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(plugins, "entry_points", only(registered()))
    with pytest.raises(RolePluginError, match=r"no 'worker' entry point.*pip install -e \."):
        worker_factory()


def test_an_entry_point_of_the_wrong_shape_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(plugins, "entry_points", only(registered(("infer", "workers.role:WORKER"))))
    with pytest.raises(RolePluginError, match="WorkerRole without `start_inference`"):
        inference_factory()


def test_two_registrations_of_one_role_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    twice = registered(("worker", "workers.role:WORKER"), ("worker", "other.role:WORKER"))
    monkeypatch.setattr(plugins, "entry_points", only(twice))
    with pytest.raises(RolePluginError, match="more than once"):
        worker_factory()
