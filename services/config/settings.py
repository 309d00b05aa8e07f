"""Connection settings for the broker and the store.

Every role gets a `Settings` object passed in; nothing reads the environment except
`load_settings`, which is called once at the edge (the CLI).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from broker.topology import QueueLimits

DEFAULT_AMQP_URL = "amqp://guest:guest@127.0.0.1:5672/%2F"
DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class TLSSettings(_Section):
    """Client-side TLS. Use amqps:// or rediss:// URLs together with these files."""

    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    verify_hostname: bool = True


def _comma_separated(value: object) -> object:
    """A list given as one string ("a,b"), as environment variables give it."""
    if isinstance(value, str):
        return tuple(part.strip() for part in value.split(",") if part.strip())
    return value


class BrokerSettings(_Section):
    kind: Literal["memory", "rabbitmq"] = "memory"
    # With `amqp_urls` set, its first URL (the user, password and vhost of every node).
    amqp_url: str = DEFAULT_AMQP_URL
    # A cluster's nodes (SPLITMQ_AMQP_URLS="url1,url2,url3"): each connection goes to a live
    # one and moves to another when its node goes (docs/deployment.md, "Local cluster").
    amqp_urls: tuple[str, ...] = ()
    # How the job's durable queues are kept: "quorum" (replicated over the nodes, surviving a
    # node's death), "classic" (on one node), or "auto": quorum with more than one node.
    queue_type: Literal["auto", "classic", "quorum"] = "auto"
    # Quorum queues: deliveries of one message before it is dead-lettered (x-delivery-limit).
    delivery_limit: int = Field(default=20, gt=0)
    # RabbitMQ 3.x accepts 128 MiB by default, 4.x only 16 MiB: set this to the server's limit.
    max_message_bytes: int = Field(default=128 * 1024 * 1024, gt=0)
    heartbeat_s: int = Field(default=60, ge=0)
    blocked_connection_timeout_s: float = Field(default=300.0, gt=0)
    reconnect_max_backoff_s: float = Field(default=10.0, gt=0)
    reconnect_give_up_s: float = Field(default=300.0, gt=0)
    shard_queue_max_length: int = Field(default=10_000, gt=0)
    shard_queue_max_bytes: int = Field(default=1 << 30, gt=0)
    tls: TLSSettings = TLSSettings()
    # Only check that exchanges and queues exist, never declare or bind: for a user without
    # configure permission (the secured mode's clients, docs/deployment.md "Security").
    passive_declare: bool = False
    # Dead-letter by rejecting (the queue's own dead-letter exchange routes it; the reason is
    # only logged): for a user without write permission on splitmq.dead (the same clients).
    dead_letter_by_nack: bool = False

    _urls_as_list = field_validator("amqp_urls", mode="before")(_comma_separated)

    @model_validator(mode="before")
    @classmethod
    def _first_node(cls, data: Any) -> Any:
        """`amqp_url` is the first node's when only `amqp_urls` is given; both given: the
        one must be among the others, or two settings would name different brokers."""
        if not isinstance(data, dict) or not data.get("amqp_urls"):
            return data
        urls = _comma_separated(data["amqp_urls"])
        if not isinstance(urls, tuple | list) or not urls:
            return data  # the field's own validation says what is wrong
        if "amqp_url" not in data:
            return {**data, "amqp_url": urls[0]}
        if data["amqp_url"] not in urls:
            raise ValueError(
                "broker.amqp_url is not one of broker.amqp_urls: set only amqp_urls for a "
                "cluster (amqp_url is then its first node)"
            )
        return data

    @property
    def urls(self) -> tuple[str, ...]:
        """Every node to connect to."""
        return self.amqp_urls or (self.amqp_url,)

    @property
    def quorum(self) -> bool:
        """Whether the job's durable queues are quorum queues."""
        if self.queue_type == "auto":
            return len(self.urls) > 1
        return self.queue_type == "quorum"

    @property
    def queue_limits(self) -> QueueLimits:
        return QueueLimits(self.shard_queue_max_length, self.shard_queue_max_bytes)


class StoreSettings(_Section):
    kind: Literal["memory", "redis"] = "memory"
    redis_url: str = DEFAULT_REDIS_URL
    keep_versions: int = Field(default=5, ge=1)
    socket_timeout_s: float = Field(default=30.0, gt=0)
    # How long a role waits for Redis to come back (e.g. a restart) before failing; 0: never.
    retry_for_s: float = Field(default=120.0, ge=0)
    retry_max_backoff_s: float = Field(default=2.0, gt=0)
    tls: TLSSettings = TLSSettings()
    # Redis Sentinel ("host:port" each): when set, the store writes to the primary they name
    # `master_name` and follows it through a failover; redis_url then only supplies the db,
    # the credentials and the scheme (rediss:// for TLS, to the sentinels too).
    sentinels: tuple[str, ...] = ()
    master_name: str = Field(default="splitmq", min_length=1)
    # WAIT for this many replicas after a version commit or a checkpoint save, so that what a
    # role was told is stored survives the primary (docs/reliability.md, "Redis with Sentinel").
    min_replicas: int = Field(default=0, ge=0)
    replica_timeout_s: float = Field(default=2.0, gt=0)

    @field_validator("sentinels", mode="before")
    @classmethod
    def _sentinel_list(cls, value: object) -> object:
        # SPLITMQ_REDIS_SENTINELS="a:26379,b:26379": environment values arrive as one string.
        value = _comma_separated(value)
        if isinstance(value, (list, tuple)):
            for entry in value:
                cls.sentinel_address(entry)
        return value

    @staticmethod
    def sentinel_address(entry: object) -> tuple[str, int]:
        """("host", port) of one store.sentinels entry; a ValueError naming the setting."""
        where = "(store.sentinels, SPLITMQ_REDIS_SENTINELS)"
        if not isinstance(entry, str):
            raise ValueError(f"a sentinel must be a 'host:port' string, got {entry!r} {where}")
        host, colon, port = entry.strip().rpartition(":")
        host = host.removeprefix("[").removesuffix("]")  # [::1]:26379
        if not colon or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"sentinel {entry!r} is not 'host:port' with a port 1-65535 {where}")
        return host, int(port)

    @field_validator("replica_timeout_s")
    @classmethod
    def _wait_within_socket_timeout(cls, value: float, info: ValidationInfo) -> float:
        socket_timeout = info.data.get("socket_timeout_s")
        if info.data.get("min_replicas") and socket_timeout and value >= socket_timeout:
            raise ValueError(
                f"store.replica_timeout_s ({value:g} s) must be below store.socket_timeout_s "
                f"({socket_timeout:g} s): WAIT holds the socket that long"
            )
        return value

    @property
    def sentinel_addresses(self) -> tuple[tuple[str, int], ...]:
        return tuple(self.sentinel_address(entry) for entry in self.sentinels)


class SecuritySettings(_Section):
    """The secured deployment (design §3; docs/deployment.md "Security")."""

    # One RabbitMQ user per client (`splitmq provision-clients`): clients stamp the AMQP
    # user_id, which RabbitMQ validates, and services dead-letter a client message without
    # one or whose `client` field names another user.
    per_client_users: bool = False
    # AMQP users whose RoundStart / RoundEnd markers workers accept in the secured mode,
    # besides the user of this process's own broker.amqp_url (the services' user).
    service_users: tuple[str, ...] = ()

    # SPLITMQ_SECURITY__SERVICE_USERS="a,b": environment values arrive as one string.
    _users_as_list = field_validator("service_users", mode="before")(_comma_separated)


class ConnectionSettings(_Section):
    """Where the broker and the store are."""

    broker: BrokerSettings = BrokerSettings()
    store: StoreSettings = StoreSettings()
    security: SecuritySettings = SecuritySettings()
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    # "json": one JSON object per line with job, client, shard and version (--log-format).
    log_format: Literal["text", "json"] = "text"
