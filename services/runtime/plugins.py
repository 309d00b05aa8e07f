"""The roles services/ builds without importing their package: the worker and its split-inference
server, found through the `splitmq.roles` entry points (pyproject.toml).

workers/ imports services/ (config, algorithms, security); if the runtime and the CLI imported
workers/ back to build a worker, the two packages would form a cycle. So the worker package
registers one factory per entry point (workers/role.py), and this module loads it by name and
checks it against the protocol below before anyone calls it. A checkout whose package metadata
predates an entry point (pyproject.toml changed, not reinstalled) gets the command to run.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from importlib.metadata import entry_points
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from broker.errors import SplitMQError

if TYPE_CHECKING:
    from services.common.backends import Backends
    from services.common.schedule import Entry
    from services.common.supervise import Role
    from services.config.root import Settings

ROLE_GROUP = "splitmq.roles"


class RolePluginError(SplitMQError):
    """A role's entry point is missing, ambiguous, or names an object of the wrong shape."""


@runtime_checkable
class WorkerFactory(Protocol):
    """Entry point `worker`: builds a worker (the server-side layers) for the runtime."""

    def build_worker(
        self,
        settings: Settings,
        backends: Backends,
        *,
        worker_id: str,
        script: Mapping[int, Sequence[Entry]] | None = None,
    ) -> Role:
        """`script`: a replay's record, each shard's stream by shard (issue 36)."""
        ...


@runtime_checkable
class InferenceFactory(Protocol):
    """Entry point `infer`: starts a split-inference server (SplitGP) on a thread of its own
    and returns what stops and joins it (`splitmq infer --serve`)."""

    def start_inference(
        self, settings: Settings, backends: Backends, *, worker_id: str, logger: logging.Logger
    ) -> Callable[[], None]: ...


def worker_factory() -> WorkerFactory:
    found = _load("worker")
    if not isinstance(found, WorkerFactory):
        raise RolePluginError(_wrong_shape("worker", found, "build_worker"))
    return found


def inference_factory() -> InferenceFactory:
    found = _load("infer")
    if not isinstance(found, InferenceFactory):
        raise RolePluginError(_wrong_shape("infer", found, "start_inference"))
    return found


def _load(name: str) -> object:
    matches = entry_points(group=ROLE_GROUP, name=name)
    if not matches:
        raise RolePluginError(
            f"no {name!r} entry point in group {ROLE_GROUP!r}: the installed package metadata "
            "is missing or older than pyproject.toml; reinstall with `pip install -e .`"
        )
    if len(matches) > 1:
        # Two installed distributions claim the role: which one runs must not be chance.
        values = ", ".join(sorted(point.value for point in matches))
        raise RolePluginError(f"{name!r} is registered more than once in {ROLE_GROUP!r}: {values}")
    (point,) = matches
    loaded: object = point.load()
    return loaded


def _wrong_shape(name: str, found: object, method: str) -> str:
    return (
        f"entry point {name!r} of {ROLE_GROUP!r} is a {type(found).__name__} without "
        f"`{method}`; reinstall with `pip install -e .` if pyproject.toml names another object"
    )
