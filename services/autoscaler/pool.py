"""What the autoscaler needs from a backend that runs workers: start one, stop one gently.

`stop_worker` sends SIGTERM and returns at once; `reap` reports the worker once it has exited.
No backend kills a worker it scales down (docs/deployment.md, "Autoscaling workers").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class PoolWorker:
    """One worker a backend runs. `key` ties it to its store member `worker:<id>`: the id is
    `key` itself or starts with `key-` (a container's worker id is `worker-<hostname>-<pid>`)."""

    name: str
    key: str
    stopping: bool = False

    def owns(self, worker_id: str) -> bool:
        return worker_id == self.key or worker_id.startswith(f"{self.key}-")


@dataclass(frozen=True)
class Exited:
    name: str
    code: int | None  # None: unknown (e.g. the container was removed by someone else)


class WorkerPool(Protocol):
    def workers(self) -> list[PoolWorker]:
        """Every worker this backend runs, the stopping ones included, oldest first."""

    def start_worker(self) -> PoolWorker: ...

    def stop_worker(self, name: str) -> None:
        """Ask `name` to stop gracefully; returns without waiting."""

    def reap(self) -> list[Exited]:
        """Workers that exited since the last call (they are gone from `workers()`)."""

    def close(self) -> None:
        """The autoscaler stops: release what the backend holds (see each backend)."""
