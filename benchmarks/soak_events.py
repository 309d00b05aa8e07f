"""The soak's chaos driven by what the job does, not by the clock (issue 18 item 7).

One client leaves by SIGTERM and rejoins with the same id, and one worker is SIGKILLed,
each at a point of the job that the driver observes, so the run means the same on a quiet
and on a loaded machine:

1. When the tap has seen `leave_after` of the leaver's batches (mid-way through its first
   round, which cannot close before the leaver is dropped): SIGKILL a worker (a replacement
   starts), then SIGTERM the leaver. The kill therefore lands while the round is open.
2. As soon as the leaver's process is gone and the coordinator has removed it from the
   membership in the store: start it again.
3. The job must not run out of rounds before the rejoined client is back: once the round the
   leaver left has closed (the store's version moved on) and the rejoined client is not yet a
   live member, the aggregator is paused (SIGSTOP) until it is (SIGCONT). The round that opens
   next has the rejoined client in its cohort however long its process took to start. The
   pause waits until the aggregator has moved past the leave on its own, so that the run
   exercises the round closing without the leaver, not only the rejoin (an aggregator paused
   across both would see the leaver back as a new process and stop waiting for it then).

A paused aggregator is itself a fault the service takes (a stalled host): clients wait for the
next assignment without a timeout, and the pause stays well inside the AMQP heartbeat.
"""

from __future__ import annotations

import logging
import random
import signal
import threading
import time
from collections.abc import Callable
from enum import Enum
from typing import TYPE_CHECKING

from broker.store import WeightStore
from services.common.membership import client_members

if TYPE_CHECKING:
    from benchmarks.soak import Children, SoakConfig, SoakReport, Tap

LOG = logging.getLogger("splitmq.soak")

_POLL_S = 0.05
# A SIGTERMed client that has not exited by then is SIGKILLed (its Leave is then missing and
# the coordinator sees it go only when its membership expires).
_EXIT_GRACE_S = 30.0


class _Phase(Enum):
    LEAVE = "waiting for the leave point"
    GONE = "waiting for the coordinator to see the leave"
    BACK = "waiting for the rejoined client to be a member"
    DONE = "done"


class EventChaos:
    def __init__(
        self,
        cfg: SoakConfig,
        children: Children,
        report: SoakReport,
        rng: random.Random,
        tap: Tap,
        store: WeightStore,
        *,
        job: str,
        kill_worker: Callable[[], None],
        start_client: Callable[[int], None],
    ) -> None:
        self._cfg = cfg
        self._children = children
        self._report = report
        self._tap = tap
        self._store = store
        self._job = job
        self._kill_worker = kill_worker
        self._start_client = start_client
        self._leaver = rng.randrange(cfg.clients)
        self._name = f"client-{self._leaver}"
        self._leave_after = cfg.leave_after_batches or max(1, cfg.steps // 2)
        self.phase = _Phase.LEAVE
        self._left_at_version = 0
        self._term_at = 0.0
        self._paused_at: float | None = None

    def run(self, stop: threading.Event, started: Callable[[], float | None]) -> None:
        try:
            while not stop.wait(_POLL_S) and self.phase is not _Phase.DONE:
                started()  # keeps the run's notion of "training began" up to date
                self._step()
        finally:
            self._resume()
            if self.phase is not _Phase.DONE:
                self._report.problems.append(f"chaos script stopped while {self.phase.value}")

    def _step(self) -> None:
        if self.phase is _Phase.LEAVE:
            if self._tap.count(self._name) >= self._leave_after:
                self._left_at_version = self._store.current_version(self._job)
                self._kill_worker()
                LOG.info("%s leaves (SIGTERM) after %d batches", self._name, self._leave_after)
                self._children.signal(self._name, signal.SIGTERM)
                self._report.client_leaves_sigterm += 1
                self._term_at = time.monotonic()
                self.phase = _Phase.GONE
            return
        self._pause_if_needed()
        members = client_members(self._store, self._job)
        if self.phase is _Phase.GONE:
            process = self._children.procs[self._name]
            if process.poll() is None:
                if time.monotonic() - self._term_at > _EXIT_GRACE_S:
                    LOG.warning("%s ignored SIGTERM; killing it", self._name)
                    self._children.signal(self._name, signal.SIGKILL)
                return
            if self._name not in members:
                LOG.info("the coordinator saw %s leave; starting it again", self._name)
                self._start_client(self._leaver)
                self.phase = _Phase.BACK
            return
        member = members.get(self._name)
        if member is not None and member.ready:
            LOG.info("%s is a member again", self._name)
            self._report.client_rejoins += 1
            self._resume()
            self.phase = _Phase.DONE
        elif self._paused_at is not None and time.monotonic() - self._paused_at > (
            self._cfg.max_pause_s
        ):
            self._report.problems.append(
                f"{self._name} was not back {self._cfg.max_pause_s:.0f} s into the pause"
            )
            self._resume()

    def _pause_if_needed(self) -> None:
        if self._paused_at is not None or self._report.aggregator_pauses:
            return  # one pause at most
        if self._store.current_version(self._job) > self._left_at_version:
            LOG.info("round of the leave closed; pausing the aggregator until the rejoin")
            self._children.signal("aggregator", signal.SIGSTOP)
            self._paused_at = time.monotonic()
            self._report.aggregator_pauses += 1

    def _resume(self) -> None:
        if self._paused_at is None:
            return
        self._children.signal("aggregator", signal.SIGCONT)
        self._report.aggregator_paused_s += time.monotonic() - self._paused_at
        self._paused_at = None
