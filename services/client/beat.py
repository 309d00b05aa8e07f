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
import threading
from collections.abc import Callable

from broker.codec import encode
from broker.errors import BackPressureError, BrokerError, UnroutableError
from broker.messages import Heartbeat, new_message_id
from broker.topology import CONTROL_EXCHANGE
from broker.transport import Broker, PublishOptions

# How long `stop` waits for a beat in flight (a publish retrying through a broker outage).
STOP_WAIT_S = 5.0


class HeartbeatThread:
    """Publishes `Heartbeat(job, client, version())` every `interval_s` until stopped.

    `version` is read on the thread (the latest weights version the client knows). `sent` and
    `bytes_sent` are written by the thread only; read them after `stop`.
    """

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
        self._open_broker = open_broker
        self._job = job
        self._client = client
        self._interval_s = interval_s
        self._version = version
        self._log = logger
        self._halt = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"heartbeat-{client}", daemon=True)
        self.sent = 0
        self.bytes_sent = 0

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = STOP_WAIT_S) -> bool:
        """Stop beating; whether the thread has ended (a daemon left in a publish otherwise)."""
        self._halt.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def _run(self) -> None:
        broker: Broker | None = None
        failing = False
        try:
            while not self._halt.is_set():
                try:
                    if broker is None:
                        broker = self._open_broker()
                    self._beat(broker)
                    if failing:
                        self._log.info("%s: heartbeats delivered again", self._client)
                    failing = False
                except (BackPressureError, UnroutableError) as exc:
                    # The next one will do: a full or missing control queue is the service
                    # side's state, not this connection's.
                    self._log.debug("%s: heartbeat not delivered: %s", self._client, exc)
                except BrokerError as exc:
                    if not failing:  # once per outage, not every beat
                        self._log.warning("%s: cannot send heartbeats: %s", self._client, exc)
                    failing = True
                    _closed(broker)
                    broker = None  # a fresh handle next time
                self._halt.wait(self._interval_s)
        finally:
            _closed(broker)

    def _beat(self, broker: Broker) -> None:
        message = Heartbeat(self._job, self._client, new_message_id(), self._version())
        body = encode(message)
        broker.publish(CONTROL_EXCHANGE, self._job, body, PublishOptions(message.message_id))
        self.sent += 1
        self.bytes_sent += len(body)


def _closed(broker: Broker | None) -> None:
    if broker is not None:
        try:
            broker.close()
        except BrokerError:
            pass  # it is dropped either way
