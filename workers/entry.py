"""A worker as a process of its own (the `multiprocessing` target and the CLI's entry)."""

from __future__ import annotations

import logging
import signal
import threading

from services.common.backends import Backends
from services.config.root import Settings
from workers.stats import WorkerStats
from workers.worker import Worker


def run_worker_process(settings_json: str, worker_id: str | None = None) -> WorkerStats:
    """Run one worker until SIGTERM or SIGINT, then hand its shards over gracefully.

    Takes the settings as JSON so a `spawn`ed child gets them without pickling objects. Only
    real backends make sense here: the in-memory ones do not cross processes.
    """
    settings = Settings.model_validate_json(settings_json)
    logging.basicConfig(
        level=settings.log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s"
    )
    stop = threading.Event()

    def request_stop(signum: int, _frame: object) -> None:
        logging.getLogger("splitmq.worker").info("signal %d: stopping", signum)
        stop.set()

    signal.signal(signal.SIGTERM, request_stop)
    signal.signal(signal.SIGINT, request_stop)
    backends = Backends(settings.broker, settings.store)
    return Worker(settings, backends, worker_id=worker_id).run(stop)
