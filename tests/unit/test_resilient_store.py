"""`ResilientStore` over a store that fails on demand: waits, gives up, logs, publishes once."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import pytest
import torch

from broker.errors import StoreError, StoreUnavailableError, VersionConflictError
from broker.memory_store import InMemoryWeightStore
from broker.resilient_store import PUBLISH_ID_KEY, ResilientStore, RetryPolicy
from broker.store import NO_VERSION, BlobRef, JobStatus, Weights

JOB = "j"
BLOBS: Mapping[BlobRef, Weights] = {BlobRef("client"): {"w": torch.ones(3)}}


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


class FlakyStore(InMemoryWeightStore):
    """Fails the next `failures` calls to the store methods named in `flaky`.

    `lose_reply` makes a failing publish commit first and then fail, as when Redis went away
    after running the commit but before its reply arrived."""

    def __init__(self, failures: int = 0, *, lose_reply: bool = False) -> None:
        super().__init__()
        self.failures = failures
        self.lose_reply = lose_reply
        self.calls: dict[str, int] = {}

    def _maybe_fail(self, name: str) -> None:
        self.calls[name] = self.calls.get(name, 0) + 1
        if self.failures > 0:
            self.failures -= 1
            raise StoreUnavailableError(f"redis unreachable during {name}")

    def current_version(self, job: str) -> int:
        self._maybe_fail("current_version")
        return super().current_version(job)

    def publish_version(self, job: str, expected_current: int, *args: Any, **kw: Any) -> int:
        if self.lose_reply and self.failures > 0:
            super().publish_version(job, expected_current, *args, **kw)
        self._maybe_fail("publish_version")
        return super().publish_version(job, expected_current, *args, **kw)

    def acquire_lease(self, job: str, name: str, owner: str, ttl_s: float) -> bool:
        self._maybe_fail("acquire_lease")
        return super().acquire_lease(job, name, owner, ttl_s)


def resilient(inner: FlakyStore, clock: FakeClock, retry_for_s: float = 10.0) -> ResilientStore:
    policy = RetryPolicy(retry_for_s=retry_for_s, first_backoff_s=0.1, max_backoff_s=1.0)
    return ResilientStore(
        inner, policy, logger=logging.getLogger("test.store"), clock=clock, sleep=clock.sleep
    )


def test_a_call_waits_out_an_outage_with_capped_backoff_and_says_so(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = FakeClock()
    inner = FlakyStore(failures=6)
    store = resilient(inner, clock)
    with caplog.at_level(logging.INFO, logger="test.store"):
        assert store.acquire_lease(JOB, "shard:0", "w1", 5.0)
    assert inner.calls["acquire_lease"] == 7
    assert clock.sleeps == pytest.approx([0.1, 0.2, 0.4, 0.8, 1.0, 1.0])
    messages = [r.getMessage() for r in caplog.records]
    waiting = [m for m in messages if "waiting for Redis" in m]
    assert len(waiting) == 1  # once per outage, not once per retry
    assert waiting[0].startswith("store unavailable (acquire_lease: redis unreachable")
    assert messages[-1] == "store back after 3.5 s"  # 0.1+0.2+0.4+0.8+1+1, from the first failure
    assert store.outages == 1
    assert store.lease_owner(JOB, "shard:0") == "w1"


def test_a_call_gives_up_after_retry_for_s(caplog: pytest.LogCaptureFixture) -> None:
    clock = FakeClock()
    store = resilient(FlakyStore(failures=1000), clock, retry_for_s=5.0)
    with caplog.at_level(logging.ERROR, logger="test.store"), pytest.raises(StoreUnavailableError):
        store.current_version(JOB)
    assert clock.now == pytest.approx(5.0)  # the last sleep is cut to what is left
    assert "giving up" in caplog.records[-1].getMessage()


def test_zero_retry_for_s_fails_at_once() -> None:
    clock = FakeClock()
    with pytest.raises(StoreUnavailableError):
        resilient(FlakyStore(failures=1), clock, retry_for_s=0.0).current_version(JOB)
    assert clock.sleeps == []


def test_other_store_errors_pass_straight_through() -> None:
    clock = FakeClock()
    store = resilient(FlakyStore(), clock)
    with pytest.raises(StoreError):
        store.read_blob(JOB, 1, BlobRef("client"))
    assert clock.sleeps == []


def test_a_publish_whose_reply_was_lost_is_not_published_twice() -> None:
    clock = FakeClock()
    inner = FlakyStore(failures=1, lose_reply=True)
    store = resilient(inner, clock)
    assert store.publish_version(JOB, NO_VERSION, BLOBS, meta={"round": "0"}) == 1
    assert inner.versions(JOB) == [1]  # recognised as ours, not retried into version 2
    meta = inner.manifest(JOB, 1).meta
    assert meta["round"] == "0" and PUBLISH_ID_KEY in meta
    assert inner.calls["publish_version"] == 1


def test_a_publish_that_never_committed_is_retried() -> None:
    clock = FakeClock()
    inner = FlakyStore(failures=2)  # the publish, then the look at the current version
    store = resilient(inner, clock)
    assert store.publish_version(JOB, NO_VERSION, BLOBS) == 1
    assert inner.calls["publish_version"] == 2
    assert inner.versions(JOB) == [1]


def test_someone_elses_version_during_the_outage_is_a_conflict() -> None:
    clock = FakeClock()
    inner = FlakyStore(failures=1)
    store = resilient(inner, clock)

    def rival_publishes(seconds: float) -> None:
        if not inner.versions(JOB):
            InMemoryWeightStore.publish_version(inner, JOB, NO_VERSION, BLOBS)
        clock.sleep(seconds)

    store._sleep = rival_publishes
    with pytest.raises(VersionConflictError) as caught:
        store.publish_version(JOB, NO_VERSION, BLOBS)
    assert (caught.value.expected, caught.value.actual) == (0, 1)


def test_policy_rejects_nonsense() -> None:
    with pytest.raises(ValueError):
        RetryPolicy(retry_for_s=-1)
    with pytest.raises(ValueError):
        RetryPolicy(first_backoff_s=3.0, max_backoff_s=1.0)


def test_the_job_status_passes_through() -> None:
    inner = FlakyStore()
    store = resilient(inner, FakeClock())
    store.set_job_status(JOB, JobStatus("failed", "diverged"))
    assert inner.job_status(JOB) == JobStatus("failed", "diverged")
    assert store.job_status(JOB) == JobStatus("failed", "diverged")
    store.clear_job_status(JOB)
    assert inner.job_status(JOB) is None and store.job_status(JOB) is None
