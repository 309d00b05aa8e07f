"""Run role objects on threads and watch them: the job ends, a role dies, or someone says stop.

The job is over when the aggregator's `run` returns (it returns once the last round closed) or
raises `JobFailedError` (the job failed, its clients were dismissed); clients then get a short
grace period to take their final assignment and leave, and everything else is stopped through
the shared event. A role that raises anything else stops the whole run: an embedded run with
a dead worker or coordinator would otherwise just hang until a deadline.
"""

from __future__ import annotations

import logging
import threading
import time
import traceback
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

from services.common.logs import log_context

RoleKind = Literal["coordinator", "aggregator", "worker", "client"]

_POLL_S = 0.25


class JobFailedError(Exception):
    """A role ended the job as failed by its own decision (the aggregator, when no round can
    make progress), after telling the clients the job is over: not a crash. The message is the
    reason; the run's status is `failed: <reason>`."""


class Role(Protocol):
    def run(self, stop: threading.Event) -> object: ...


@dataclass(frozen=True)
class RoleSpec:
    name: str  # e.g. "worker-0"; also the thread name
    kind: RoleKind
    role: Role


@dataclass(frozen=True)
class Outcome:
    """How a run ended: an embedded one (threads) or `splitmq up`'s (processes)."""

    # "finished", "stopped", "interrupted", "timeout" (`up`), "failed: <role>: <error>",
    # "failed: <reason>"
    status: str
    failed_role: str = ""
    traceback: str = ""
    stuck: tuple[str, ...] = ()  # roles that did not stop within the join timeout
    exit_codes: Mapping[str, int | None] = field(default_factory=dict)  # `up`'s children

    @property
    def ok(self) -> bool:
        return self.status == "finished"

    @property
    def exit_code(self) -> int:
        if self.ok:
            return 0
        return 130 if self.status in ("stopped", "interrupted") else 1


class _RoleThread:
    def __init__(self, spec: RoleSpec, stop: threading.Event, changed: threading.Event) -> None:
        self.spec = spec
        self._stop = stop
        self._changed = changed
        self.done = False
        self.error: BaseException | None = None
        self.job_failure = ""  # the reason of a `JobFailedError`: the job ended, as failed
        self.traceback = ""
        # Daemon: a role that ignores the stop event must not keep the process alive forever.
        self.thread = threading.Thread(target=self._main, name=spec.name, daemon=True)

    def _main(self) -> None:
        try:
            # JSON log lines of an embedded run say which role (and which worker or client).
            member = (
                {self.spec.kind: self.spec.name} if self.spec.kind in ("worker", "client") else {}
            )
            with log_context(role=self.spec.kind, **member):
                self.spec.role.run(self._stop)
        except JobFailedError as exc:
            self.job_failure = str(exc) or "job failed"
        except BaseException as exc:  # reported to the supervisor, not lost
            self.error = exc
            self.traceback = traceback.format_exc()
        finally:
            self.done = True
            self._changed.set()


class Supervisor:
    """Starts the roles in the given order and returns an `Outcome` once the run is over."""

    def __init__(
        self,
        roles: Sequence[RoleSpec],
        stop: threading.Event,
        *,
        client_grace_s: float = 10.0,
        join_timeout_s: float = 30.0,
        logger: logging.Logger | None = None,
    ) -> None:
        if sum(1 for r in roles if r.kind == "aggregator") != 1:
            raise ValueError("a run needs exactly one aggregator")
        self._stop = stop
        self._changed = threading.Event()
        self._threads = [_RoleThread(spec, stop, self._changed) for spec in roles]
        self._client_grace_s = client_grace_s
        self._join_timeout_s = join_timeout_s
        self._log = logger or logging.getLogger("splitmq.runtime")

    def run(self) -> Outcome:
        for t in self._threads:
            t.thread.start()
        failed: _RoleThread | None = None
        try:
            status, failed = self._watch()
        except KeyboardInterrupt:
            status = "interrupted"
            self._log.warning("interrupted: stopping all roles")
        self._stop.set()
        stuck = self._join()
        return Outcome(
            status=status,
            failed_role=failed.spec.name if failed else "",
            traceback=failed.traceback if failed else "",
            stuck=stuck,
        )

    def _watch(self) -> tuple[str, _RoleThread | None]:
        finished_at: float | None = None
        while True:
            self._changed.wait(_POLL_S)
            self._changed.clear()
            failed = next((t for t in self._threads if t.error is not None), None)
            if failed is not None:
                self._log.error("%s died: %r; stopping the run", failed.spec.name, failed.error)
                return f"failed: {failed.spec.name}: {failed.error!r}", failed
            if self._stop.is_set():
                return "stopped", None
            aggregator = next(t for t in self._threads if t.spec.kind == "aggregator")
            if not aggregator.done:
                continue
            if finished_at is None:
                finished_at = time.monotonic()
            # A failed job ends like a finished one: its clients were dismissed and leave.
            clients = [t for t in self._threads if t.spec.kind == "client"]
            grace_over = time.monotonic() - finished_at > self._client_grace_s
            if all(t.done for t in clients) or grace_over:
                failure = aggregator.job_failure
                return (f"failed: {failure}" if failure else "finished"), None

    def _join(self) -> tuple[str, ...]:
        deadline = time.monotonic() + self._join_timeout_s
        stuck: list[str] = []
        for t in self._threads:
            t.thread.join(max(0.0, deadline - time.monotonic()))
            if t.thread.is_alive():
                stuck.append(t.spec.name)
            elif t.error is not None and t.traceback:
                self._log.debug("%s ended with %r during shutdown", t.spec.name, t.error)
        if stuck:
            self._log.warning("roles still running after stop: %s", ", ".join(stuck))
        return tuple(stuck)
