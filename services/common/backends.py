"""Open the configured broker and store: real servers, or the embedded in-process ones."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from broker.memory_broker import InMemoryBroker, InMemoryHub
from broker.memory_store import InMemoryWeightStore
from broker.rabbitmq import RabbitMQBroker
from broker.rabbitmq_connection import RabbitMQOptions
from broker.redis_store import NO_RETRY, RedisStoreOptions, RedisWeightStore, RetryPolicy
from broker.store import WeightStore
from broker.tls import TLSOptions
from broker.transport import Broker
from services.config.settings import BrokerSettings, StoreSettings, TLSSettings
from services.metrics.broker import BrokerMeter
from services.metrics.recorder import NO_METERS, NO_METRICS, Meters, Metrics


def tls_options(settings: TLSSettings) -> TLSOptions | None:
    """The broker layer's TLS options; None when the section keeps its defaults (system CAs,
    hostname checked), so a plain amqp:// or redis:// URL stays valid, and amqps:// or
    rediss:// get the defaults."""
    return None if settings == TLSSettings() else TLSOptions(**settings.model_dump())


@dataclass
class Embedded:
    """The in-process hub and store that every role of an embedded run shares."""

    hub: InMemoryHub = field(default_factory=InMemoryHub)
    store: InMemoryWeightStore = field(default_factory=InMemoryWeightStore)


@dataclass(frozen=True)
class Backends:
    """How a role opens its connections; each thread opens its own broker handle."""

    broker_settings: BrokerSettings
    store_settings: StoreSettings
    embedded: Embedded | None = None
    # The process's recorders, and the one bound to the role these backends were made for
    # (`for_role`): its broker handles report bytes, waits and dead letters to it.
    meters: Meters = NO_METERS
    metrics: Metrics = NO_METRICS

    def for_role(self, kind: str, member: str = "") -> Backends:
        """These backends for one role: its broker handles and its code report to its recorder."""
        return replace(self, metrics=self.meters.role(kind, member))

    def open_broker(
        self,
        name: str = "",
        *,
        stamp: str | None = None,
        give_up_after: float | None = None,
        sleep: Callable[[float], None] = time.sleep,
    ) -> Broker:
        """A new handle, metered for this role. `stamp`: the AMQP user_id its publishes carry
        (`identity.service_user`, the secured client's user); `give_up_after` shortens the
        reconnect budget (probes, health checks), `sleep` waits between reconnect attempts (one
        that raises ends the wait early)."""
        settings = self.broker_settings
        meter = BrokerMeter(self.metrics) if self.metrics.enabled else None
        if settings.kind == "memory":
            hub = self._embedded().hub
            limit = settings.max_message_bytes
            return InMemoryBroker(hub, max_message_bytes=limit, stamp=stamp, meter=meter)
        options = RabbitMQOptions(
            heartbeat=settings.heartbeat_s,
            blocked_connection_timeout=settings.blocked_connection_timeout_s,
            reconnect_max_delay=settings.reconnect_max_backoff_s,
            give_up_after=give_up_after or settings.reconnect_give_up_s,
            max_message_bytes=settings.max_message_bytes,
            connection_name=name or None,
            tls=tls_options(settings.tls),
            passive_declare=settings.passive_declare,
            dead_letter_by_nack=settings.dead_letter_by_nack,
            queue_type="quorum" if settings.quorum else "classic",
            delivery_limit=settings.delivery_limit,
        )
        return RabbitMQBroker(settings.urls, options, sleep=sleep, stamp=stamp, meter=meter)

    def open_store(
        self,
        *,
        wait: bool = True,
        give_up_after: float | None = None,
        sleep: Callable[[float], None] = time.sleep,
    ) -> WeightStore:
        """`wait`: ride out a Redis outage for `retry_for_s` (roles), or `give_up_after`
        seconds; False for probes and health checks, which must report an outage rather than
        sit through it. `sleep` waits between retries (one that raises ends the wait early)."""
        settings = self.store_settings
        if settings.kind == "memory":
            return self._embedded().store  # never unavailable
        retry_for_s = settings.retry_for_s if give_up_after is None else give_up_after
        policy = RetryPolicy(
            retry_for_s=retry_for_s,
            first_backoff_s=min(0.1, settings.retry_max_backoff_s),
            max_backoff_s=settings.retry_max_backoff_s,
        )
        options = RedisStoreOptions(
            socket_timeout_s=settings.socket_timeout_s,
            keep_versions=settings.keep_versions,
            tls=tls_options(settings.tls),
            retry=policy if wait else NO_RETRY,
            sentinels=settings.sentinel_addresses,
            master_name=settings.master_name,
            min_replicas=settings.min_replicas,
            replica_timeout_s=settings.replica_timeout_s,
        )
        return RedisWeightStore(settings.redis_url, options, sleep=sleep)

    def _embedded(self) -> Embedded:
        if self.embedded is None:
            raise ValueError(
                "the in-memory broker/store only exist inside one process: use `splitmq run`, "
                'or configure kind = "rabbitmq" / "redis" for separate processes'
            )
        return self.embedded
