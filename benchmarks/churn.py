"""Clients that join late and leave early, for embedded runs that simulate churn (async mode's
tests and `benchmarks/async_vs_sync.py`; no product code uses it, so it lives here).

A `ChurningRole` wraps a client role: it starts the client only once its `join` condition
holds, and stops it (the client sends its Leave) once its `leave` condition holds, or when
the run stops. Conditions are polled, so they may read the clock or the store.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from services.common.backends import Backends
from services.common.supervise import Role, RoleSpec
from services.config.root import Settings
from services.data.loaders import Dataset
from services.report.records import MetricsSink
from services.runtime.roles import embedded_roles

Condition = Callable[[], bool]
_POLL_S = 0.1


def never() -> bool:
    return False


def always() -> bool:
    return True


def after(seconds: float, clock: Callable[[], float] = time.monotonic) -> Condition:
    """True from `seconds` after this call on."""
    at = clock() + seconds
    return lambda: clock() >= at


@dataclass(frozen=True)
class Churn:
    """When one client joins and leaves (conditions made when the run's roles are built)."""

    join: Callable[[], Condition] = lambda: always
    leave: Callable[[], Condition] = lambda: never


class ChurningRole:
    def __init__(self, role: Role, join: Condition, leave: Condition) -> None:
        self._role = role
        self._join = join
        self._leave = leave

    def run(self, stop: threading.Event) -> object:
        while not self._join():
            if stop.wait(_POLL_S):
                return None
        own = threading.Event()

        def watch() -> None:
            while not stop.wait(_POLL_S):
                if self._leave():
                    break
            own.set()

        watcher = threading.Thread(target=watch, name="churn-watch", daemon=True)
        watcher.start()
        try:
            return self._role.run(own)
        finally:
            own.set()
            watcher.join()


def churn_roles(
    plan: Mapping[int, Churn],
) -> Callable[[Settings, Backends, MetricsSink, Dataset], Sequence[RoleSpec]]:
    """A `run_embedded` role builder whose client `i` churns as `plan[i]` says (others join at
    once and stay)."""

    def build(
        settings: Settings, backends: Backends, sink: MetricsSink, dataset: Dataset
    ) -> Sequence[RoleSpec]:
        out: list[RoleSpec] = []
        for spec in embedded_roles(settings, backends, sink, dataset):
            index = int(spec.name.rsplit("-", 1)[1]) if spec.kind == "client" else -1
            churn = plan.get(index)
            if churn is None:
                out.append(spec)
                continue
            role = ChurningRole(spec.role, churn.join(), churn.leave())
            out.append(RoleSpec(spec.name, spec.kind, role))
        return out

    return build
