"""A worker: holds shard leases, consumes those shards' queues, trains their replicas.

`Worker.run(stop)` blocks until `stop` is set (or, with `burst=True`, until its shard queues
are empty and everything is checkpointed), then hands its shards over gracefully: checkpoint,
ack what the checkpoint covers, unsubscribe (unacked deliveries return to their queues),
release the leases. A crash skips all of that; the leases expire and another worker resumes
from the checkpoints, the unacked deliveries being redelivered to it (design §7).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable

from services.algorithms.base import Strategy, serves_inference
from services.algorithms.registry import build_strategy
from services.common.backends import Backends
from services.config.root import Settings
from workers.inference import start_inference
from workers.model import ModelFactory, job_model
from workers.session import WorkerSession, WorkerSpec
from workers.stats import WorkerStats


def default_worker_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


class Worker:
    """One worker of a job; `run` it on the thread that will own its broker handle.

    `strategy` and `model_factory` default to the job's (`[algorithm]`, `[model]` and the
    dataset's image shape); `clock` drives lease ticks, checkpoint intervals and the barrier
    timeout; `poll_s` bounds how long a `get` waits, i.e. how quickly `stop` is noticed.
    """

    def __init__(
        self,
        settings: Settings,
        backends: Backends,
        *,
        worker_id: str | None = None,
        strategy: Strategy | None = None,
        model_factory: ModelFactory | None = None,
        clock: Callable[[], float] = time.monotonic,
        poll_s: float = 0.2,
        logger: logging.Logger | None = None,
    ) -> None:
        self.settings = settings
        self.worker_id = worker_id or default_worker_id()
        self.strategy = strategy or build_strategy(
            settings.algorithm.name, settings.algorithm.params()
        )
        self.model_factory = model_factory or (lambda: job_model(settings))
        self.clock = clock
        self.poll_s = poll_s
        self.logger = logger or logging.getLogger("splitmq.worker")
        self._backends = backends

    def run(self, stop: threading.Event, *, burst: bool = False) -> WorkerStats:
        stats = WorkerStats()
        if not self.strategy.splits:
            # FedAvg trains whole models on the clients: no server side, no shard to serve.
            # Idle rather than fail, so one compose file serves every algorithm.
            self.logger.warning(
                "worker %s: algorithm %s has no server-side model; idling until stopped",
                self.worker_id,
                self.strategy.name,
            )
            if not burst:
                stop.wait()
            return stats
        store = self._backends.open_store()
        try:
            broker = self._backends.open_broker(f"splitmq-worker-{self.worker_id}")
        except BaseException:
            store.close()
            raise
        spec = WorkerSpec(
            self.settings,
            self.worker_id,
            self.strategy,
            self.model_factory,
            self.clock,
            self.poll_s,
            self.logger,
            metrics=self._backends.metrics,
        )
        # Split inference (SplitGP) on a connection and thread of its own: ahead of training.
        inference = (
            start_inference(
                self.settings,
                self._backends,
                worker_id=self.worker_id,
                model_factory=self.model_factory,
                logger=self.logger,
            )
            if serves_inference(self.strategy)
            else None
        )
        session: WorkerSession | None = None
        try:
            session = WorkerSession(spec, broker, store, stop, stats)
            session.start()
            session.loop(burst)
            session.hand_over_all()
        except Exception:
            # Our own failure: give the shards away now rather than after the lease TTL; the
            # unacked deliveries go back with the connection and are applied on top of the
            # last checkpoints, exactly as after a crash.
            self.logger.exception("worker %s failed", self.worker_id)
            if session is not None:
                session.release_all()
            raise
        finally:
            if inference is not None:
                inference.close()
            try:
                broker.close()
            finally:
                store.close()
        self.logger.info("worker %s stopped: %s", self.worker_id, stats)
        return stats
