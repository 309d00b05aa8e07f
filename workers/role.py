"""What the worker package offers the runtime, through the `splitmq.roles` entry points
(pyproject.toml): services/ builds a worker and starts an inference server through these
objects without importing workers/, which imports services/. Each satisfies a protocol of
services/runtime/plugins.py, checked where it is loaded (and by tests/unit/test_role_plugins.py).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence

from services.common.backends import Backends
from services.common.jobmodel import job_model
from services.common.schedule import Entry
from services.config.root import Settings
from workers.inference import InferenceServer
from workers.worker import Worker


class WorkerRole:
    """Entry point `worker`."""

    def build_worker(
        self,
        settings: Settings,
        backends: Backends,
        *,
        worker_id: str,
        script: Mapping[int, Sequence[Entry]] | None = None,
    ) -> Worker:
        """`script`: a replay's shard streams by shard (`Worker`)."""
        return Worker(settings, backends, worker_id=worker_id, script=script)


class InferenceRole:
    """Entry point `infer`: the server a worker runs beside training, alone (`--serve`)."""

    def start_inference(
        self, settings: Settings, backends: Backends, *, worker_id: str, logger: logging.Logger
    ) -> Callable[[], None]:
        server = InferenceServer(
            settings,
            backends,
            worker_id=worker_id,
            model_factory=lambda: job_model(settings),
            logger=logger,
        )
        return server.start()


WORKER = WorkerRole()
INFER = InferenceRole()
