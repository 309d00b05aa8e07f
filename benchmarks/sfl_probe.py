"""`splitmq worker` with a stopwatch: the benchmark's worker process.

    python -m benchmarks.sfl_probe CONFIG --id worker-0 --trace trace.json

Runs the very `workers.worker.Worker` that `splitmq worker` runs, over the same RabbitMQ and
Redis handles, with one difference: its broker handles' meter is a `ReplyClock`, which notes
the instant of every message the worker's broker has confirmed, with its routing key (the
client, for a GradientReply), body size and how long the publish blocked the worker. Those
instants are what `benchmarks.sfl_throughput` counts samples between. On SIGTERM the worker
hands its shard over as usual and the trace is written.

Why a meter and not the worker's own counters: `Worker.run` keeps its `WorkerStats` private
until it returns, and the steady-state window needs per-reply timestamps, which nothing logs.
The meter costs one clock read and one list append per publish.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from broker.rabbitmq import RabbitMQBroker
from broker.transport import Broker
from services.cli.common import stop_on_signals
from services.common.backends import Backends
from services.common.logs import configured_logging
from services.config.loading import load_settings
from workers.worker import Worker

# One reply: (monotonic seconds after its confirm, routing key, body bytes, seconds the
# publish took: pika's work plus the wait for RabbitMQ's confirm).
Reply = tuple[float, str, int, float]


class ReplyClock:
    """A `broker.transport.Meter` that timestamps each confirmed publish of the worker's handle
    (its GradientReplies; the deployment picks them by routing key and size)."""

    def __init__(self, replies: list[Reply], clock: Callable[[], float] = time.monotonic) -> None:
        self._replies = replies
        self._clock = clock

    def sent(self, routing_key: str, nbytes: int, seconds: float) -> None:
        self._replies.append((self._clock(), routing_key, nbytes, seconds))

    def received(self, nbytes: int, waited_s: float) -> None:
        pass

    def dead_lettered(self, reason: str | None) -> None:
        pass


@dataclass(frozen=True)
class RecordingBackends(Backends):
    """The job's backends, handing out recording broker handles."""

    replies: list[Reply] = field(default_factory=list)

    def open_broker(self, name: str = "", **kwargs: Any) -> Broker:
        broker = super().open_broker(name, **kwargs)
        if isinstance(broker, RabbitMQBroker):
            broker.meter = ReplyClock(self.replies)
        return broker


def main() -> None:
    parser = argparse.ArgumentParser(description="a worker that timestamps its replies")
    parser.add_argument("config", type=Path)
    parser.add_argument("--id", dest="worker_id", default="worker-0")
    parser.add_argument("--trace", type=Path, required=True, help="where the JSON trace goes")
    args = parser.parse_args()
    settings = load_settings(args.config, os.environ)
    replies: list[Reply] = []
    backends = RecordingBackends(settings.broker, settings.store, replies=replies)
    stop = threading.Event()
    context = {"role": "worker", "job": settings.job.name, "worker": args.worker_id}
    with configured_logging(settings.log_level, json_lines=False, context=context):
        with stop_on_signals(stop):
            stats = Worker(settings, backends, worker_id=args.worker_id).run(stop)
        logging.getLogger("splitmq.worker").info("probe: %d replies timed", len(replies))
    trace = {"replies": replies, "batches_applied": stats.batches_applied, "steps": stats.steps}
    args.trace.write_text(json.dumps(trace))


if __name__ == "__main__":
    main()
