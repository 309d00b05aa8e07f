"""SplitMQ's own error hierarchy. Library exceptions (pika, redis, msgpack, safetensors) are
wrapped at the boundary, so callers never need to import those libraries.
"""

from __future__ import annotations


class SplitMQError(Exception):
    """Base class of every error SplitMQ raises on purpose."""


class DecodeError(SplitMQError):
    """A message body or weight blob failed validation; ``reason`` says precisely why."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class UnexpectedMessageError(DecodeError):
    """A valid message of a type that does not belong where it arrived (`decode`'s `expect`)."""

    def __init__(self, type_name: str, expected: str) -> None:
        super().__init__(f"{type_name} does not belong here (expected {expected})")
        self.type_name = type_name


class EncodeError(SplitMQError):
    """A message could not be encoded (unsupported dtype, oversize, non-finite values...)."""


class BrokerError(SplitMQError):
    """Base class of message-broker failures."""


class BrokerUnavailableError(BrokerError):
    """The broker cannot be reached (after retrying, where retrying applies)."""


class BrokerAuthError(BrokerError):
    """The broker refused the login (user, password) or the user's access to the vhost; never
    retried: waiting does not fix credentials."""


class ConnectionSettingsError(SplitMQError, ValueError):
    """A broker or store URL (or its TLS options) that cannot work, refused before connecting."""


class BackPressureError(BrokerError):
    """The broker refused a publish because the target queue is full: nothing was enqueued; the
    caller should slow down and retry later."""


class UnroutableError(BrokerError):
    """A mandatory publish matched no queue (wrong routing key or queue not declared)."""


class MessageTooLargeError(BrokerError):
    """A body exceeds the broker's configured maximum message size."""


class StaleDeliveryError(BrokerError):
    """Ack/nack of a delivery that belongs to a connection which has since been lost: the broker
    will redeliver the message; the caller must not treat it as handled."""


class StoreError(SplitMQError):
    """Base class of weight-store failures."""


class StoreUnavailableError(StoreError):
    """The store cannot be reached."""


class StoreAuthError(StoreError):
    """The store refused the credentials of its URL; never retried."""


class LeaseNotHeldError(StoreError):
    """A write guarded by a lease was refused: the writer does not hold that lease (any more)."""


class VersionConflictError(StoreError):
    """A compare-and-set version bump lost the race: the current version is not the expected one."""

    def __init__(self, expected: int, actual: int) -> None:
        super().__init__(f"version conflict: expected current version {expected}, found {actual}")
        self.expected = expected
        self.actual = actual


class VersionNotFoundError(StoreError):
    """The requested version was never published or has been removed by retention."""
