"""`ResilientStore`: a `WeightStore` that rides out a store outage (e.g. a Redis restart).

On `StoreUnavailableError` it logs once per outage that it is waiting, retries with capped
exponential backoff, logs when the store is back, and re-raises once a call has waited
`retry_for_s`. Every other error passes straight through.

Why each retry is safe (docs/reliability.md "Redis restart"):
- reads (`current_version`, `manifest`, `read_blob`, `versions`, `load_checkpoint`,
  `live_members`, `lease_owner`, `job_status`) change nothing, apart from pruning expired
  members;
- `save_checkpoint`, `heartbeat`, `remove_member`, `release_lease`, `set_job_status`,
  `clear_job_status`, `delete_job` replace or delete by key, so running them twice leaves what
  running them once does;
- `acquire_lease` takes or renews the lease for the same owner: a retry after a lost reply
  finds the lease already ours and renews it;
- `publish_version` is a compare-and-set, and its outcome after a disconnect is unknown. A blind
  retry would either lose (the first try committed: `VersionConflictError` for our own version)
  or, worse, be mistaken for another aggregator's win. So each publication carries an id in its
  manifest meta, and before retrying we re-read the current version: still `expected` -> the
  first try did not commit, try again (the blobs are content-addressed, written NX); moved on ->
  ours if the manifest of `expected + 1` carries our id, otherwise a real conflict.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

from broker.errors import StoreUnavailableError, VersionConflictError, VersionNotFoundError
from broker.store import BlobRef, Checkpoint, JobStatus, Manifest, Member, Weights, WeightStore

if TYPE_CHECKING:
    import torch

T = TypeVar("T")

# Manifest meta key naming the publication, so a retry can recognise its own commit.
PUBLISH_ID_KEY = "publish_id"


@dataclass(frozen=True)
class RetryPolicy:
    # How long one call waits for the store before the error reaches the caller (0: never wait).
    retry_for_s: float = 120.0
    first_backoff_s: float = 0.1
    max_backoff_s: float = 2.0

    def __post_init__(self) -> None:
        if self.retry_for_s < 0:
            raise ValueError(f"retry_for_s must be >= 0, got {self.retry_for_s}")
        if not 0 < self.first_backoff_s <= self.max_backoff_s:
            raise ValueError("backoffs must satisfy 0 < first_backoff_s <= max_backoff_s")


class ResilientStore:
    """Thread-safe when the wrapped store is; the outage state is shared by all threads."""

    def __init__(
        self,
        inner: WeightStore,
        policy: RetryPolicy | None = None,
        *,
        logger: logging.Logger | None = None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self._inner = inner
        self._policy = policy or RetryPolicy()
        self._log = logger or logging.getLogger("splitmq.store")
        self._clock = clock
        self._sleep = sleep
        self._lock = threading.Lock()
        self._down_since: float | None = None
        self.outages = 0  # outages seen (for tests and gauges)

    @property
    def inner(self) -> WeightStore:
        return self._inner

    # --- the retry loop -----------------------------------------------------------------------
    def _call(self, what: str, op: Callable[[], T]) -> T:
        first_failure: float | None = None
        delay = self._policy.first_backoff_s
        while True:
            try:
                result = op()
            except StoreUnavailableError as exc:
                now = self._clock()
                self._went_down(what, exc, now)
                first_failure = now if first_failure is None else first_failure
                left = self._policy.retry_for_s - (now - first_failure)
                if left <= 0:
                    self._log.error(
                        "store still unavailable after %.1f s (%s): giving up",
                        now - first_failure,
                        what,
                    )
                    raise
                self._sleep(min(delay, left))
                delay = min(delay * 2, self._policy.max_backoff_s)
                continue
            self._came_back()
            return result

    def _went_down(self, what: str, exc: StoreUnavailableError, now: float) -> None:
        with self._lock:
            if self._down_since is not None:
                return
            self._down_since = now
            self.outages += 1
        self._log.warning(
            "store unavailable (%s: %s): waiting for Redis up to %.0f s",
            what,
            exc,
            self._policy.retry_for_s,
        )

    def _came_back(self) -> None:
        with self._lock:
            if self._down_since is None:
                return
            down_s = self._clock() - self._down_since
            self._down_since = None
        self._log.warning("store back after %.1f s", down_s)

    # --- versions -----------------------------------------------------------------------------
    def current_version(self, job: str) -> int:
        return self._call("current_version", lambda: self._inner.current_version(job))

    def publish_version(
        self,
        job: str,
        expected_current: int,
        blobs: Mapping[BlobRef, Weights],
        *,
        samples: Mapping[BlobRef, int] | None = None,
        meta: Mapping[str, str] | None = None,
    ) -> int:
        publish_id = uuid.uuid4().hex
        tagged = {**(meta or {}), PUBLISH_ID_KEY: publish_id}
        tried = False

        def attempt() -> int:
            nonlocal tried
            if tried:  # the last try's outcome is unknown: look before publishing again
                committed = self._own_commit(job, expected_current, publish_id)
                if committed is not None:
                    return committed
            tried = True
            return self._inner.publish_version(
                job, expected_current, blobs, samples=samples, meta=tagged
            )

        return self._call("publish_version", attempt)

    def _own_commit(self, job: str, expected: int, publish_id: str) -> int | None:
        """The version our earlier try committed; None if it did not (retry); raises
        `VersionConflictError` if someone else's publication moved the version on."""
        current = self._inner.current_version(job)
        if current == expected:
            return None
        if current > expected:
            try:
                manifest = self._inner.manifest(job, expected + 1)
            except VersionNotFoundError:
                manifest = None
            if manifest is not None and manifest.meta.get(PUBLISH_ID_KEY) == publish_id:
                self._log.info("job %s: version %d was committed before the outage", job, current)
                return expected + 1
        raise VersionConflictError(expected, current)

    def manifest(self, job: str, version: int) -> Manifest:
        return self._call("manifest", lambda: self._inner.manifest(job, version))

    def read_blob(self, job: str, version: int, ref: BlobRef) -> dict[str, torch.Tensor]:
        return self._call("read_blob", lambda: self._inner.read_blob(job, version, ref))

    def versions(self, job: str) -> list[int]:
        return self._call("versions", lambda: self._inner.versions(job))

    # --- shard checkpoints --------------------------------------------------------------------
    def save_checkpoint(
        self, job: str, checkpoint: Checkpoint, *, holder: tuple[str, str] | None = None
    ) -> None:
        # A replace: idempotent; with `holder` the store itself refuses a writer that lost the
        # lease during the outage.
        self._call(
            "save_checkpoint",
            lambda: self._inner.save_checkpoint(job, checkpoint, holder=holder),
        )

    def load_checkpoint(self, job: str, shard: int) -> Checkpoint | None:
        return self._call("load_checkpoint", lambda: self._inner.load_checkpoint(job, shard))

    # --- membership ---------------------------------------------------------------------------
    def heartbeat(
        self, job: str, member_id: str, ttl_s: float, info: Mapping[str, str] | None = None
    ) -> None:
        self._call("heartbeat", lambda: self._inner.heartbeat(job, member_id, ttl_s, info))

    def remove_member(self, job: str, member_id: str) -> None:
        self._call("remove_member", lambda: self._inner.remove_member(job, member_id))

    def live_members(self, job: str) -> dict[str, Member]:
        return self._call("live_members", lambda: self._inner.live_members(job))

    # --- leases -------------------------------------------------------------------------------
    def acquire_lease(self, job: str, name: str, owner: str, ttl_s: float) -> bool:
        return self._call(
            "acquire_lease", lambda: self._inner.acquire_lease(job, name, owner, ttl_s)
        )

    def release_lease(self, job: str, name: str, owner: str) -> None:
        self._call("release_lease", lambda: self._inner.release_lease(job, name, owner))

    def lease_owner(self, job: str, name: str) -> str | None:
        return self._call("lease_owner", lambda: self._inner.lease_owner(job, name))

    # --- how the job ended --------------------------------------------------------------------
    def set_job_status(self, job: str, status: JobStatus) -> None:
        self._call("set_job_status", lambda: self._inner.set_job_status(job, status))

    def job_status(self, job: str) -> JobStatus | None:
        return self._call("job_status", lambda: self._inner.job_status(job))

    def clear_job_status(self, job: str) -> None:
        self._call("clear_job_status", lambda: self._inner.clear_job_status(job))

    # --- operations ---------------------------------------------------------------------------
    def delete_job(self, job: str) -> None:
        self._call("delete_job", lambda: self._inner.delete_job(job))

    def close(self) -> None:
        self._inner.close()
