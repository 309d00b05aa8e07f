"""The aggregator role: version 1 at start-up (architecture step 1), then the job's clock (sync
rounds or async buffering, `core`) until `job.rounds` versions are trained. A job name used
again: docs/reliability.md, **An ended job stays ended**.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence

from broker.errors import VersionConflictError
from broker.store import JOB_FAILED, NO_VERSION, JobStatus, WeightStore
from broker.topology import updates_queue_name
from broker.transport import Broker
from services.aggregator.budget import SenderBudgets
from services.aggregator.buffered import BufferClock
from services.aggregator.core import Core, Stats
from services.aggregator.evaluation import Evaluator
from services.aggregator.gate import MemberBook, UpdateScreen
from services.aggregator.inbox import InboxStats, UpdateInbox
from services.aggregator.rounds import RoundClock
from services.algorithms.base import Strategy
from services.algorithms.registry import build_strategy
from services.common.backends import Backends
from services.common.jobmodel import job_model
from services.common.outbox import Outbox
from services.common.supervise import JobFailedError
from services.config.root import Settings
from services.report.records import MetricsSink, VersionRecord
from services.security.identity import sender_check, service_user


def ended_job(store: WeightStore, job: str) -> JobStatus | None:
    """How the job ended, if it has; None when it runs or is new (no version yet: a leftover
    status is cleared when version 1 is seeded)."""
    status = store.job_status(job)
    return None if status is None or store.current_version(job) == NO_VERSION else status


def ensure_initial_version(
    store: WeightStore, settings: Settings, strategy: Strategy, logger: logging.Logger
) -> int:
    """Publish version 1 from the seeded model unless some version exists; the current version.

    Two aggregators starting together both build the model, one commits, the other's
    compare-and-set fails and it adopts the winner's version 1 (identical anyway: same seed).
    Seeding starts the job anew: a status left by an earlier run of the name is cleared first
    (before version 1 exists, so no role can take the new run for the old one's end).
    """
    job = settings.job.name
    current = store.current_version(job)
    if current != NO_VERSION:
        return current
    if store.job_status(job) is not None:
        logger.info("job %s: no version yet; clearing the status of an earlier run", job)
        store.clear_job_status(job)
    model = job_model(settings, seed=settings.job.seed)
    blobs = strategy.initial_weights(model, settings.model.cut)
    try:
        version = store.publish_version(job, NO_VERSION, blobs, meta={"round": "-1"})
    except VersionConflictError as exc:
        logger.info("job %s: version %d was published by someone else", job, exc.actual)
        return store.current_version(job)
    logger.info("job %s: published initial version %d (seed %d)", job, version, settings.job.seed)
    return version


# Held (unacked) updates count against the prefetch: leave room for a whole cohort plus the
# late and malformed ones that arrive meanwhile.
_PREFETCH_SLACK = 16


class Aggregator:
    def __init__(
        self,
        settings: Settings,
        backends: Backends,
        *,
        sink: MetricsSink,
        evaluator: Evaluator | None = None,
        strategy: Strategy | None = None,
        clock: Callable[[], float] = time.monotonic,
        pace: Callable[[], float] = time.monotonic,
        poll_s: float = 0.1,
        cohorts: Mapping[int, Sequence[str]] | None = None,
    ) -> None:
        """`clock` times the rounds (deadlines, round_s); `pace` what bounds costs per second
        (reads of the members, `MemberBook`; the senders' budgets): a round clock held still
        (a test's) must not freeze the view of the members. `cohorts`: a replay's recorded
        cohort per round index, drawn by the seed otherwise (sync rounds only)."""
        self._cohorts = dict(cohorts or {})
        self._settings = settings
        self._backends = backends
        self._sink = sink
        self._evaluator = evaluator
        # Bound to the job's model where aggregation needs its structure (FedSplitX).
        self._strategy = (
            strategy or build_strategy(settings.algorithm.name, settings.algorithm.params())
        ).for_model(lambda: job_model(settings), settings.model.cut)
        self._clock = clock
        self._pace = pace
        self._log = logging.getLogger("splitmq.aggregator")
        self._poll_s = poll_s
        self.stats = Stats()
        self.inbox_stats = InboxStats()
        refusal = self._strategy.async_refusal() if settings.asynchronous_mode else None
        if refusal is not None:
            raise ValueError(f"rounds.mode = 'async' is not possible: {refusal}")

    @property
    def job(self) -> str:
        return self._settings.job.name

    def run(self, stop: threading.Event) -> list[VersionRecord]:
        """Run the job's rounds; the records of the versions this aggregator published.

        Returns early when `stop` is set (the sink is told "stopped"); a failure of the broker
        or the store propagates after the sink is told "failed: ...", and a job that cannot make
        progress raises `JobFailedError` once the clients are dismissed.
        """
        # In the secured mode its round markers carry its AMQP user, which workers check.
        user = service_user(self._settings)
        broker = self._backends.open_broker("aggregator", stamp=user)
        store = self._backends.open_store()
        try:
            ended = ended_job(store, self.job)
            if ended is not None:
                records, status = self._already_ended(ended)
            else:
                records, status = self.core(broker, store, stop).run()
        except JobFailedError as exc:  # ended by decision; the clients were dismissed
            self._sink.finish(f"failed: {exc}")
            raise
        except Exception as exc:
            self._sink.finish(f"failed: {type(exc).__name__}: {exc}")
            raise
        finally:
            broker.close()
            store.close()
        self._sink.finish(status)
        return records

    def _already_ended(self, ended: JobStatus) -> tuple[list[VersionRecord], str]:
        """A restart after the end (compose, `splitmq aggregator` again): reopening rounds would
        only wait for clients that were dismissed. A failed job fails this run the same way."""
        self._log.warning(
            "job %s already ended (%s): not resuming it; delete the job's keys to run it again "
            "(`splitmq up` does, compose `down -v`)",
            self.job,
            ended.text,
        )
        if ended.state == JOB_FAILED:
            raise JobFailedError(ended.detail)
        return [], ended.text

    def _member_book(self, store: WeightStore) -> MemberBook:
        """Members read at most once a heartbeat interval between round openings (never more
        often than once a second, the rate before there were intervals); one that left is
        remembered for as long as a sync round may wait for it."""
        clients, rounds = self._settings.clients, self._settings.rounds
        refresh_s = max(1.0, clients.heartbeat_s)
        return MemberBook(store, self.job, self._pace, refresh_s, 2 * rounds.deadline_s)

    def core(self, broker: Broker, store: WeightStore, stop: threading.Event) -> Core:
        """Declare and subscribe; the job's clock (sync or async) over `broker` and `store`,
        ready to run."""
        broker.declare(self._settings.job_queues())
        prefetch = self._settings.clients.count + _PREFETCH_SLACK
        broker.subscribe(updates_queue_name(self.job), prefetch=prefetch)
        outbox = Outbox(broker, self.job, self._log)
        version = ensure_initial_version(store, self._settings, self._strategy, self._log)
        members = self._member_book(store)
        server = self._strategy.server
        partial = server is not None and server.partial_client_updates
        inbox = UpdateInbox(
            broker,
            outbox,
            self.job,
            self._log,
            screen=UpdateScreen.of(store, self.job, version, members, partial=partial),
            stats=self.inbox_stats,
            metrics=self._backends.metrics,
            senders=sender_check(self._settings),
            budgets=SenderBudgets(clock=self._pace),
        )
        args = (
            self._settings,
            store,
            outbox,
            inbox,
            self._strategy,
            self._sink,
            self._evaluator,
            self._clock,
            stop,
            self._log,
            self._poll_s,
            self.stats,
        )
        if self._settings.asynchronous_mode:
            return BufferClock(*args)
        return RoundClock(*args, cohorts=self._cohorts)
