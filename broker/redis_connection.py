"""The one way the Redis store reaches Redis: `RedisConnection`, shared by its parts
(`broker.redis_versions`, `broker.redis_checkpoints`, `broker.redis_members`).

redis errors never escape: connection problems become `StoreUnavailableError`, the rest
`StoreError`. Every operation goes through `RedisConnection.call`, which rides out an outage,
so every step must be idempotent: docs/reliability.md, "Redis restart", says how each one is.

With `RedisStoreOptions.sentinels` the connection follows the primary that Redis Sentinel names
and rides out a failover the same way (docs/reliability.md, "Redis with Sentinel"); with
`min_replicas` a version commit or checkpoint save returns only once that many replicas have
it (WAIT, `RedisConnection.replicated`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import redis
from redis.backoff import ExponentialBackoff, NoBackoff
from redis.connection import parse_url
from redis.retry import Retry
from redis.sentinel import Sentinel

from broker.errors import StoreAuthError, StoreError, StoreUnavailableError
from broker.store_codec import positive_ttl
from broker.tls import TLSOptions, redis_ssl_kwargs, wants_tls

T = TypeVar("T")


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


NO_RETRY = RetryPolicy(retry_for_s=0.0)


@dataclass(frozen=True)
class RedisStoreOptions:
    # Generous read timeout: one blob can be tens of MB over a slow link.
    socket_timeout_s: float = 30.0
    socket_connect_timeout_s: float = 5.0
    # Retries of a command after a connection error or timeout (every step is idempotent).
    retries: int = 2
    keep_versions: int = 5
    # How long an uncommitted blob lives: long enough for a slow publisher to commit.
    pending_ttl_s: float = 600.0
    # TLS for rediss:// URLs (None: system CAs, hostname checked); refused with redis://.
    tls: TLSOptions | None = None
    # How long an operation waits out an outage (roles); probes and health checks fail at once.
    retry: RetryPolicy = field(default=NO_RETRY)
    # Redis Sentinel: (host, port) of each sentinel; empty: the URL's host is the server.
    sentinels: tuple[tuple[str, int], ...] = ()
    master_name: str = "splitmq"
    # Replicas that must acknowledge a version commit or a checkpoint save (WAIT), and for how
    # long one WAIT may block; fewer acks count as an outage (retried, then unavailable).
    min_replicas: int = 0
    replica_timeout_s: float = 2.0

    def __post_init__(self) -> None:
        if self.keep_versions < 1:
            raise ValueError(f"keep_versions must be >= 1, got {self.keep_versions}")
        if not self.pending_ttl_s > 0:
            raise ValueError(f"pending_ttl_s must be positive, got {self.pending_ttl_s}")
        if self.min_replicas < 0:
            raise ValueError(f"min_replicas must be >= 0, got {self.min_replicas}")
        if not self.replica_timeout_s > 0 or (
            self.min_replicas and self.replica_timeout_s >= self.socket_timeout_s
        ):
            raise ValueError(
                f"replica_timeout_s must be positive and below socket_timeout_s (WAIT holds "
                f"the socket), got {self.replica_timeout_s} and {self.socket_timeout_s}"
            )


class _NotReplicated(Exception):
    """WAIT came back with fewer replicas than `min_replicas`: waited out like an outage."""


# Replies a primary gives while Sentinel moves the role (a demoted primary refusing writes,
# min-replicas-to-write refusing them while replicas reconnect, a WAIT cut short by the
# demotion, a replica whose link to the primary is down): with Sentinel, transient.
_FAILOVER_REPLIES = ("READONLY", "NOREPLICAS", "UNBLOCKED", "MASTERDOWN")


def as_bytes(raw: object) -> bytes:
    # decode_responses=False makes every reply bytes; the check narrows redis-py's loose types.
    if isinstance(raw, bytes):
        return raw
    if isinstance(raw, str):
        return raw.encode()
    raise StoreError(f"unexpected redis reply {raw!r}")


def as_text(raw: object) -> str:
    return as_bytes(raw).decode()


def byte_hash(fields: Mapping[Any, Any]) -> dict[bytes, bytes]:
    return {as_bytes(k): as_bytes(v) for k, v in fields.items()}


def millis(ttl_s: float) -> int:
    return max(1, round(positive_ttl(ttl_s) * 1000))


class RedisConnection:
    """A redis-py client (thread-safe: its connection pool), the Sentinel that names its
    primary if any, and the outage state all threads share."""

    def __init__(
        self,
        url: str,
        options: RedisStoreOptions,
        *,
        logger: logging.Logger,
        clock: Callable[[], float],
        sleep: Callable[[float], None],
    ) -> None:
        self.options = opts = options
        tls: dict[str, Any] = {}
        if wants_tls(url, "redis", "Redis", "store.redis_url, SPLITMQ_REDIS_URL", opts.tls):
            tls = redis_ssl_kwargs(opts.tls or TLSOptions())
        common: dict[str, Any] = {
            "socket_timeout": opts.socket_timeout_s,
            "socket_connect_timeout": opts.socket_connect_timeout_s,
            # PINGs idle pooled connections every 30 s, so a dead one is noticed before use.
            "health_check_interval": 30,
            "retry": Retry(ExponentialBackoff(cap=1.0, base=0.05), opts.retries),
            "client_name": "splitmq-store",
            "decode_responses": False,
        }
        # No connection is opened here: the first command connects.
        self.sentinel: Sentinel | None = None
        if opts.sentinels:
            self.sentinel, self.client = _via_sentinel(url, opts, common, tls)
        else:
            self.client = redis.Redis.from_url(url, **common, **tls)
        self.log = logger
        self._clock = clock
        self._sleep = sleep
        self._lock = threading.Lock()  # the outage state is shared by all threads
        self._down_since: float | None = None

    def script(self, source: str) -> Any:
        """A Lua script bound to the client; no server round trip until its first use."""
        return self.client.register_script(source)

    def call(self, what: str, op: Callable[[], T]) -> T:
        """`op`'s result, with redis errors translated and outages waited out (per
        `options.retry`)."""
        policy = self.options.retry
        first_failure: float | None = None
        delay = policy.first_backoff_s
        while True:
            try:
                result = op()
            except redis.AuthenticationError as exc:  # a ConnectionError to redis-py: no retry
                raise StoreAuthError(
                    f"Redis refused the credentials of store.redis_url during {what}: {exc}"
                ) from exc
            except (redis.ConnectionError, redis.TimeoutError, _NotReplicated) as exc:
                failure: Exception = exc
            except redis.RedisError as exc:
                if not self._failing_over(exc):
                    raise StoreError(f"redis error during {what}: {exc}") from exc
                failure = exc
            else:
                self._came_back()
                return result
            if isinstance(failure, _NotReplicated):
                down = StoreUnavailableError(f"{what} not replicated: {failure}")
            else:
                down = StoreUnavailableError(f"redis unreachable during {what}: {failure}")
            if policy.retry_for_s == 0:
                raise down from failure
            now = self._clock()
            self._went_down(what, down, now)
            first_failure = now if first_failure is None else first_failure
            left = policy.retry_for_s - (now - first_failure)
            if left <= 0:
                self.log.error(
                    "store still unavailable after %.1f s (%s): giving up",
                    now - first_failure,
                    what,
                )
                raise down from failure
            self._sleep(min(delay, left))
            delay = min(delay * 2, policy.max_backoff_s)

    def replicated(
        self,
        script: Any,
        script_keys: Sequence[str],
        args: Sequence[Any],
        what: str,
        landed: Callable[[Any], bool],
    ) -> Any:
        """Run `script`; with store.min_replicas, WAIT behind it in the same round trip (WAIT
        counts the acks of its own connection's writes, so it must travel on the write's
        connection). A write that `landed` on fewer replicas raises `_NotReplicated`, an
        outage `call` retries: both scripts are idempotent."""
        need, timeout = self.options.min_replicas, self.options.replica_timeout_s
        if not need:
            return script(keys=script_keys, args=args)
        pipe = self.client.pipeline(transaction=False)
        script(keys=script_keys, args=args, client=pipe)
        pipe.wait(need, millis(timeout))
        result, acked = pipe.execute()
        if int(acked) < need and landed(result):
            raise _NotReplicated(
                f"{what} acknowledged by {acked} of store.min_replicas = {need} replicas "
                f"within {timeout:g} s"
            )
        return result

    def close(self) -> None:
        self.client.close()
        if self.sentinel is not None:
            self.sentinel.close()

    def _failing_over(self, exc: redis.RedisError) -> bool:
        """A reply that, behind Sentinel, means the primary is changing (a single server
        answering so is misconfigured, and keeps today's immediate StoreError). NOSCRIPT is
        one: a pipeline loads its scripts on the old primary, then runs EVALSHA on the promoted
        replica, which has never seen them; the retry's pipeline loads them there."""
        if self.sentinel is None or not isinstance(exc, redis.ResponseError):
            return False
        return str(exc).startswith(_FAILOVER_REPLIES) or isinstance(
            exc, redis.ReadOnlyError | redis.exceptions.NoScriptError
        )

    def _went_down(self, what: str, exc: StoreUnavailableError, now: float) -> None:
        with self._lock:
            if self._down_since is not None:
                return
            self._down_since = now
        self.log.warning(
            "store unavailable (%s: %s): waiting for Redis up to %.0f s",
            what,
            exc,
            self.options.retry.retry_for_s,
        )

    def _came_back(self) -> None:
        with self._lock:
            if self._down_since is None:
                return
            down_s = self._clock() - self._down_since
            self._down_since = None
        self.log.warning("store back after %.1f s", down_s)


class RedisPart:
    """One part of the store over a shared `RedisConnection` (`RedisWeightStore` is its three
    parts on one connection). Each part's `__init__` takes the connection and passes it on."""

    def __init__(self, db: RedisConnection) -> None:
        super().__init__()
        self._db = db

    def close(self) -> None:
        self._db.close()


def _via_sentinel(
    url: str, opts: RedisStoreOptions, common: Mapping[str, Any], tls: Mapping[str, Any]
) -> tuple[Sentinel, redis.Redis]:
    """The Sentinel client and a client of the primary it names. The URL gives the db, the
    credentials and TLS (rediss://); its host and port are not used."""
    params = {
        k: v
        for k, v in parse_url(url).items()  # type: ignore[no-untyped-call, unused-ignore]
        if k not in ("host", "port", "connection_class")
    }
    ssl: dict[str, Any] = {"ssl": True, **tls} if tls else {}
    sentinel = Sentinel(  # type: ignore[no-untyped-call, unused-ignore]
        list(opts.sentinels),
        # Sentinels answer small queries: a dead one must not hold up discovery for long. They
        # get TLS like the data nodes, no credentials (sentinels with requirepass: not yet).
        sentinel_kwargs={
            "socket_timeout": opts.socket_connect_timeout_s,
            "socket_connect_timeout": opts.socket_connect_timeout_s,
            # Discovery moves on to the next sentinel; `call` backs off between rounds.
            "retry": Retry(NoBackoff(), 0),
            **ssl,
        },
    )
    client: redis.Redis = sentinel.master_for(  # type: ignore[no-untyped-call, unused-ignore]
        opts.master_name, redis_class=redis.Redis, **common, **params, **ssl
    )
    return sentinel, client
