"""The Redis store rides out an outage: waits, gives up, logs, publishes once.

Outages are injected by making the store's calls to Redis fail (a redis-py connection error,
as a restart gives): without a server for the retry loop itself, over the real Redis for the
publications whose reply is lost.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import pytest
import redis
import torch

from broker.errors import StoreError, StoreUnavailableError, VersionConflictError
from broker.redis_store import RedisStoreOptions, RedisWeightStore, RetryPolicy
from broker.store import NO_VERSION, BlobRef, Weights

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


def resilient(
    clock: FakeClock, url: str = "redis://127.0.0.1:1/0", retry_for_s: float = 10.0
) -> RedisWeightStore:
    policy = RetryPolicy(retry_for_s=retry_for_s, first_backoff_s=0.1, max_backoff_s=1.0)
    return RedisWeightStore(
        url,
        RedisStoreOptions(retry=policy, retries=0, socket_connect_timeout_s=1.0),
        logger=logging.getLogger("test.store"),
        clock=clock,
        sleep=clock.sleep,
    )


def flaky(failures: int, then: Callable[..., Any], *, lose_reply: bool = False) -> Any:
    """`then`, failing its first `failures` calls; with `lose_reply` a failing call runs
    `then` first (Redis went away after running it, before its reply arrived)."""
    calls = {"n": 0, "failures": failures}

    def call(*args: Any, **kw: Any) -> Any:
        calls["n"] += 1
        if calls["failures"] > 0:
            calls["failures"] -= 1
            if lose_reply:
                then(*args, **kw)
            raise redis.ConnectionError("Connection refused")
        return then(*args, **kw)

    call.calls = calls  # type: ignore[attr-defined]
    return call


def test_a_call_waits_out_an_outage_with_capped_backoff_and_says_so(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = FakeClock()
    store = resilient(clock)
    store._acquire_lease = flaky(6, lambda **kw: 1)
    with caplog.at_level(logging.INFO, logger="test.store"):
        assert store.acquire_lease("j", "shard:0", "w1", 5.0)
    assert store._acquire_lease.calls["n"] == 7
    assert clock.sleeps == pytest.approx([0.1, 0.2, 0.4, 0.8, 1.0, 1.0])
    messages = [r.getMessage() for r in caplog.records]
    waiting = [m for m in messages if "waiting for Redis" in m]
    assert len(waiting) == 1  # once per outage, not once per retry
    assert waiting[0].startswith("store unavailable (acquire_lease: redis unreachable")
    assert messages[-1] == "store back after 3.5 s"  # 0.1+0.2+0.4+0.8+1+1, from the first failure


def test_a_call_gives_up_after_retry_for_s(caplog: pytest.LogCaptureFixture) -> None:
    clock = FakeClock()
    store = resilient(clock, retry_for_s=5.0)  # nothing listens on port 1
    with caplog.at_level(logging.ERROR, logger="test.store"), pytest.raises(StoreUnavailableError):
        store.current_version("j")
    assert clock.now == pytest.approx(5.0)  # the last sleep is cut to what is left
    assert "giving up" in caplog.records[-1].getMessage()


def test_zero_retry_for_s_fails_at_once() -> None:
    clock = FakeClock()
    with pytest.raises(StoreUnavailableError):
        resilient(clock, retry_for_s=0.0).current_version("j")
    assert clock.sleeps == []


def test_other_store_errors_pass_straight_through() -> None:
    clock = FakeClock()
    store = resilient(clock)

    def refused(**kw: Any) -> Any:
        raise redis.ResponseError("NOSCRIPT or some such")

    store._release_lease = refused
    with pytest.raises(StoreError) as caught:
        store.release_lease("j", "shard:0", "w1")
    assert not isinstance(caught.value, StoreUnavailableError)
    assert clock.sleeps == []


def test_policy_rejects_nonsense() -> None:
    with pytest.raises(ValueError):
        RetryPolicy(retry_for_s=-1)
    with pytest.raises(ValueError):
        RetryPolicy(first_backoff_s=3.0, max_backoff_s=1.0)


# --- a publication across an outage, over the real Redis ----------------------------------


@pytest.fixture
def real(redis_url: str, job: str) -> Iterator[tuple[RedisWeightStore, FakeClock]]:
    clock = FakeClock()
    store = resilient(clock, redis_url)
    yield store, clock
    store.delete_job(job)
    store.close()


@pytest.mark.redis
def test_a_publish_whose_reply_was_lost_is_not_published_twice(
    real: tuple[RedisWeightStore, FakeClock], job: str
) -> None:
    store, clock = real
    store._publish = flaky(1, store._publish, lose_reply=True)
    assert store.publish_version(job, NO_VERSION, BLOBS, meta={"round": "0"}) == 1
    assert store.versions(job) == [1]  # recognised as ours, not retried into version 2
    assert store.manifest(job, 1).meta == {"round": "0"}
    assert store._publish.calls["n"] == 2 and len(clock.sleeps) == 1


@pytest.mark.redis
def test_a_publish_that_never_committed_is_retried(
    real: tuple[RedisWeightStore, FakeClock], job: str
) -> None:
    store, _clock = real
    store._publish = flaky(2, store._publish)
    assert store.publish_version(job, NO_VERSION, BLOBS) == 1
    assert store._publish.calls["n"] == 3
    assert store.versions(job) == [1]


@pytest.mark.redis
def test_someone_elses_version_during_the_outage_is_a_conflict(
    real: tuple[RedisWeightStore, FakeClock], job: str, redis_url: str
) -> None:
    store, clock = real
    store._publish = flaky(1, store._publish)
    rival = RedisWeightStore(redis_url)

    def rival_publishes(seconds: float) -> None:
        if not rival.versions(job):
            rival.publish_version(job, NO_VERSION, {BlobRef("client"): {"w": torch.zeros(3)}})
        clock.sleep(seconds)

    store._db._sleep = rival_publishes  # the outage wait of the store's connection
    try:
        with pytest.raises(VersionConflictError) as caught:
            store.publish_version(job, NO_VERSION, BLOBS)
    finally:
        rival.close()
    assert (caught.value.expected, caught.value.actual) == (0, 1)


@pytest.mark.redis
def test_a_commit_that_went_through_before_a_rival_still_counts_as_ours(
    real: tuple[RedisWeightStore, FakeClock], job: str, redis_url: str
) -> None:
    """Our commit ran, its reply was lost, and a rival committed on top before the retry."""
    store, clock = real
    store._publish = flaky(1, store._publish, lose_reply=True)
    rival = RedisWeightStore(redis_url)

    def rival_publishes(seconds: float) -> None:
        if rival.current_version(job) == 1:
            rival.publish_version(job, 1, {BlobRef("client"): {"w": torch.zeros(3)}})
        clock.sleep(seconds)

    store._db._sleep = rival_publishes  # the outage wait of the store's connection
    try:
        assert store.publish_version(job, NO_VERSION, BLOBS) == 1
    finally:
        rival.close()
    assert store.versions(job) == [1, 2]
