"""A client's membership heartbeats, sent from a thread and a broker handle of their own.

Liveness must not depend on how long a training step takes. Heartbeats sent by the training
thread between steps stop whenever a step runs long: a big model on a slow edge CPU, an
evaluation at the end of a round, or a host so loaded (or a process so crowded, as `splitmq
run` with dozens of client threads is) that one step outlasts `clients.heartbeat_ttl_s`. The
coordinator then drops a client that is alive and about to upload, and the round stops waiting
for it. So the client beats from a dedicated thread, as Kafka's consumers do: the thread waits
on an event, wakes every `clients.heartbeat_s`, and publishes a Heartbeat; CPU-bound torch
steps release the GIL and the thread needs microseconds of it, so it keeps time under load.
Progress is policed elsewhere: a member that beats but never uploads is what the round
deadline is for.

pika connections are not thread-safe, so the thread opens its own handle (one more AMQP
connection per client, publish-only; in the secured mode it logs in as the same user). Its
publishes are confirmed, so once `stop` has joined the thread, the client's Leave on the main
handle lands behind its last heartbeat.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from broker.codec import encode
from broker.errors import BackPressureError, BrokerError, UnroutableError
from broker.messages import Heartbeat, new_message_id
from broker.topology import CONTROL_EXCHANGE
from broker.transport import Broker, PublishOptions
from services.common.health import Beat


class HeartbeatThread(Beat):
    """Publishes `Heartbeat(job, client, version())` every `interval_s` until stopped.

    `version` is read on the thread (the latest weights version the client knows). `sent` and
    `bytes_sent` are written by the thread only; read them after `stop` (which, with a publish
    retrying through a broker outage, waits for it at most a few seconds).
    """

    ERRORS = (BrokerError,)

    def __init__(
        self,
        open_broker: Callable[[], Broker],
        *,
        job: str,
        client: str,
        interval_s: float,
        version: Callable[[], int],
        logger: logging.Logger,
    ) -> None:
        if interval_s <= 0:
            raise ValueError(f"heartbeat interval must be positive, got {interval_s}")
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
            try:
                broker.close()
            except BrokerError:
                pass  # it is dropped either way
