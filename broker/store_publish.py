"""The publish protocol both weight stores follow; each store supplies the four storage steps.

1. serialise and hash every blob (no store access);
2. write the blobs under content-addressed keys with a pending expiry ("SET NX PX");
3. one atomic compare-and-set: version still `expected`, every blob present -> make the blobs
   permanent, write the manifest, bump the version;
4. on success apply retention; on a lost race or a torn write drop our still-pending blobs.

A crash anywhere before step 3 leaves only expiring orphans; a crash after it leaves a complete
version. The steps are methods so tests can inject a crash between blob writes.
"""

from __future__ import annotations

import contextlib
import logging
import uuid
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence

from broker import keys
from broker.errors import StoreError, StoreUnavailableError
from broker.store import NO_VERSION, BlobRef, Weights
from broker.store_codec import PreparedBlob, prepare_blobs, validate_meta

_log = logging.getLogger(__name__)


class PublishingStore(ABC):
    def publish_version(
        self,
        job: str,
        expected_current: int,
        blobs: Mapping[BlobRef, Weights],
        *,
        samples: Mapping[BlobRef, int] | None = None,
        meta: Mapping[str, str] | None = None,
    ) -> int:
        keys.validate_job(job)
        if isinstance(expected_current, bool) or not isinstance(expected_current, int):
            raise TypeError(f"expected_current must be an int, got {expected_current!r}")
        if expected_current < NO_VERSION:
            raise ValueError(f"expected_current must be >= {NO_VERSION}, got {expected_current}")
        checked_meta = validate_meta(meta)
        version = expected_current + 1
        prepared = prepare_blobs(job, version, blobs, samples)
        # Lets a retried commit whose first reply was lost recognise its own manifest.
        commit_id = uuid.uuid4().hex
        created = self._write_pending(job, prepared)
        try:
            self._commit(job, expected_current, prepared, commit_id, checked_meta)
        except StoreUnavailableError:
            raise  # outcome unknown; the pending expiry cleans up if it did not commit
        except StoreError:
            # Nobody can commit a version-`version` key any more (the version moved on or our
            # write is torn), and a committed blob is permanent, so deleting those of our blobs
            # that are still pending never hurts a winner that shares identical content. If the
            # cleanup itself fails the blobs still expire, so the original error is what matters.
            with contextlib.suppress(StoreError):
                self._discard_pending(job, created)
            raise
        try:
            self._apply_retention(job)
        except StoreError as exc:
            # The version is committed; failing the call now would make the caller retry a
            # publish that succeeded. The next publish retries retention for every stale version.
            _log.warning(
                "job %s: retention after publishing version %d failed: %s", job, version, exc
            )
        return version

    @abstractmethod
    def _write_pending(self, job: str, blobs: Sequence[PreparedBlob]) -> list[str]:
        """Write each blob unless its key exists; return the keys this call created."""

    @abstractmethod
    def _commit(
        self,
        job: str,
        expected: int,
        blobs: Sequence[PreparedBlob],
        commit_id: str,
        meta: Mapping[str, str],
    ) -> None:
        """The atomic compare-and-set; `VersionConflictError` or `StoreError` (torn write)."""

    @abstractmethod
    def _discard_pending(self, job: str, blob_keys: Sequence[str]) -> None:
        """Delete those of `blob_keys` that are still pending (never a committed blob)."""

    @abstractmethod
    def _apply_retention(self, job: str) -> None:
        """Drop whole versions older than the newest `keep_versions`."""
