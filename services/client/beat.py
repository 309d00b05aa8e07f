"""A client's membership heartbeats, from a thread and a broker handle of their own, so that
liveness does not depend on how long a training step takes (docs/reliability.md, "Liveness").
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from typing import Protocol

from broker.codec import encode
from broker.errors import BackPressureError, BrokerError, UnroutableError
from broker.messages import Heartbeat, new_message_id
from broker.topology import CONTROL_EXCHANGE
from broker.transport import Broker, PublishOptions
from services.common.health import Beat


class Heartbeats(Protocol):
    """A member's heartbeats, started once it is welcomed and stopped before its Leave: a
    thread of its own (`HeartbeatThread`), or a seat in a client host's batched beats
    (services/client/hostbeat.py). `sent` and `bytes_sent` count what it sent itself."""

    sent: int
    bytes_sent: int

    def start(self) -> None: ...

    def stop(self, timeout_s: float = 5.0) -> bool: ...


# Given the version the member knows (read at each beat), its heartbeats, not yet started.
StartBeats = Callable[[Callable[[], int]], Heartbeats]


class HeartbeatThread(Beat):
    """`sent` and `bytes_sent` are written by the thread only: read them after `stop`."""

    ERRORS = (BrokerError,)

    def __init__(
        self,
        open_broker: Callable[[], Broker],
        version: Callable[[], int],
        *,
        job: str,
        client: str,
        interval_s: float,
        logger: logging.Logger,
    ) -> None:
        super().__init__(f"heartbeat-{client}", f"the heartbeats of {client}", interval_s, logger)
        self._open_broker = open_broker
        self._broker: Broker | None = None
        self._job = job
        self._client = client
        self._version = version
        self.sent = 0
        self.bytes_sent = 0

    def beat(self) -> None:
        if self._broker is None:
            self._broker = self._open_broker()
        message = Heartbeat(self._job, self._client, new_message_id(), self._version())
        body = encode(message)
        try:
            options = PublishOptions(message.message_id)
            self._broker.publish(CONTROL_EXCHANGE, self._job, body, options)
        except (BackPressureError, UnroutableError) as exc:
            # The next one will do: a full or missing control queue is the service side's
            # state, not this connection's.
            self._log.debug("%s: heartbeat not delivered: %s", self._client, exc)
            return
        except BrokerError:
            self.end()  # a fresh handle next time
            raise
        self.sent += 1
        self.bytes_sent += len(body)

    def end(self) -> None:
        broker, self._broker = self._broker, None
        if broker is not None:
            with contextlib.suppress(BrokerError):  # it is dropped either way
                broker.close()
