"""Sentinel settings and what the store retries behind Sentinel, without a server.

The store opens no connection when it is built, so the retry loop can be driven by replacing
one of its scripts with a fake (as `test_store_retry` does) on a store aimed at nothing.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
import redis

from broker.errors import StoreError, StoreUnavailableError
from broker.redis_store import RedisStoreOptions, RedisWeightStore, RetryPolicy
from services.common.backends import Backends
from services.config.loading import ConfigError, load_settings
from services.config.settings import BrokerSettings, StoreSettings


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def store(clock: FakeClock, sentinels: tuple[tuple[str, int], ...]) -> RedisWeightStore:
    options = RedisStoreOptions(
        retry=RetryPolicy(retry_for_s=10.0, first_backoff_s=0.1, max_backoff_s=1.0),
        retries=0,
        sentinels=sentinels,
    )
    return RedisWeightStore(
        "redis://127.0.0.1:1/0",
        options,
        logger=logging.getLogger("test.sentinel"),
        clock=clock,
        sleep=clock.sleep,
    )


def failing(first: list[Exception]) -> Any:
    def call(**kw: Any) -> Any:
        if first:
            raise first.pop(0)
        return 1

    return call


@pytest.mark.parametrize(
    "reply",
    [
        redis.ReadOnlyError("You can't write against a read only replica."),
        redis.ResponseError("NOREPLICAS Not enough good replicas to write."),
        redis.ResponseError("UNBLOCKED force unblock from blocking operation"),
        redis.ResponseError("MASTERDOWN Link with MASTER is down"),
        # A pipeline's scripts loaded on the old primary, its EVALSHA run on the new one.
        redis.exceptions.NoScriptError("No matching script. Please use EVAL."),
    ],
)
def test_failover_replies_are_waited_out_behind_sentinel(reply: Exception) -> None:
    clock = FakeClock()
    s = store(clock, (("127.0.0.1", 1),))
    s._acquire_lease = failing([reply, reply])
    assert s.acquire_lease("j", "shard:0", "w1", 5.0)
    assert clock.now == pytest.approx(0.3)


def test_a_single_server_answering_readonly_fails_at_once_as_before() -> None:
    clock = FakeClock()
    s = store(clock, ())
    s._acquire_lease = failing([redis.ReadOnlyError("You can't write against a replica.")])
    with pytest.raises(StoreError) as caught:
        s.acquire_lease("j", "shard:0", "w1", 5.0)
    assert not isinstance(caught.value, StoreUnavailableError)
    assert clock.now == 0.0


def test_other_replies_still_fail_at_once_behind_sentinel() -> None:
    clock = FakeClock()
    s = store(clock, (("127.0.0.1", 1),))
    s._acquire_lease = failing([redis.ResponseError("WRONGTYPE Operation against a key")])
    with pytest.raises(StoreError) as caught:
        s.acquire_lease("j", "shard:0", "w1", 5.0)
    assert not isinstance(caught.value, StoreUnavailableError)


def test_no_sentinel_answering_is_an_outage_that_ends_in_unavailable() -> None:
    clock = FakeClock()
    s = store(clock, (("127.0.0.1", 1),))  # nothing listens on port 1
    with pytest.raises(StoreUnavailableError, match="No master found for 'splitmq'"):
        s.current_version("j")
    assert clock.now == pytest.approx(10.0)


def test_sentinels_from_the_environment_and_their_validation() -> None:
    env = {"SPLITMQ_REDIS_SENTINELS": "10.0.0.1:26379, redis-b:26380,[::1]:26381"}
    settings = load_settings(None, env).store
    assert settings.sentinel_addresses == (
        ("10.0.0.1", 26379),
        ("redis-b", 26380),
        ("::1", 26381),
    )
    assert (settings.master_name, settings.min_replicas, settings.replica_timeout_s) == (
        "splitmq",
        0,
        2.0,
    )
    for bad in ("10.0.0.1", "host:port", ":26379", "h:0", "h:70000"):
        with pytest.raises(ConfigError, match=r"store\.sentinels.*SPLITMQ_REDIS_SENTINELS"):
            load_settings(None, {"SPLITMQ_REDIS_SENTINELS": bad})
    with pytest.raises(ValueError, match=r"store\.sentinels"):
        StoreSettings(sentinels=("a:1", "b"))
    with pytest.raises(ValueError):
        StoreSettings(min_replicas=-1)


def test_backends_pass_the_sentinel_settings_to_the_store() -> None:
    settings = StoreSettings(
        kind="redis",
        redis_url="rediss://:pw@ignored:1/3",
        sentinels=("127.0.0.1:1", "127.0.0.1:2"),
        master_name="prod",
        min_replicas=1,
        replica_timeout_s=0.5,
    )
    s = Backends(BrokerSettings(), settings).open_store(wait=False)
    try:
        assert isinstance(s, RedisWeightStore)
        opts = s._db.options
        assert opts.sentinels == (("127.0.0.1", 1), ("127.0.0.1", 2))
        assert (opts.master_name, opts.min_replicas, opts.replica_timeout_s) == ("prod", 1, 0.5)
        pool = s._db.client.connection_pool
        assert pool.service_name == "prod"
        kwargs = pool.connection_kwargs
        assert (kwargs["db"], kwargs["password"]) == (3, "pw")
        assert "host" not in kwargs  # the URL's host is not where the store writes
        assert type(pool).__name__ == "SentinelConnectionPool"
        assert pool.connection_class.__name__ == "SentinelManagedSSLConnection"
        assert s._db.sentinel is not None
        sentinel_kwargs = s._db.sentinel.sentinels[0].connection_pool.connection_kwargs
        assert sentinel_kwargs.get("ssl_cert_reqs") == "required"
    finally:
        s.close()


def test_no_sentinels_keeps_the_plain_client() -> None:
    s = Backends(BrokerSettings(), StoreSettings(kind="redis")).open_store(wait=False)
    try:
        assert isinstance(s, RedisWeightStore)
        assert s._db.sentinel is None
        assert type(s._db.client.connection_pool).__name__ == "ConnectionPool"
    finally:
        s.close()


def test_a_wait_longer_than_the_socket_timeout_is_refused() -> None:
    with pytest.raises(ValueError, match=r"store\.replica_timeout_s .* store\.socket_timeout_s"):
        StoreSettings(socket_timeout_s=5.0, replica_timeout_s=5.0, min_replicas=1)
    with pytest.raises(ValueError, match="replica_timeout_s"):
        RedisStoreOptions(socket_timeout_s=1.0, replica_timeout_s=2.0, min_replicas=1)
    # Without min_replicas no WAIT is sent: a short socket timeout stays valid.
    StoreSettings(socket_timeout_s=1.0)
    RedisStoreOptions(socket_timeout_s=1.0)
