"""A client host's heartbeats (docs/architecture.md, "Client hosts"): its members in a
`Roster`, each client's seat in it (`SeatBeats`), and one batched `HostHeartbeat` for them all
every interval (`HostBeat`), over the host's publishing handles.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from broker.codec import encode
from broker.errors import BackPressureError, BrokerError, UnroutableError
from broker.messages import HostHeartbeat, new_message_id
from broker.topology import CONTROL_EXCHANGE
from broker.transport import PublishOptions
from services.client.hostlink import Publishers
from services.common.health import Beat
from services.common.membership import HOST_HEARTBEAT_MEMBERS

_BEATS_KEPT = 50_000


@dataclass
class Roster:
    """The host's members: each client's id and how to read the version it knows."""

    _members: dict[str, Callable[[], int]] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, client: str, version: Callable[[], int]) -> None:
        with self._lock:
            self._members[client] = version

    def remove(self, client: str) -> None:
        with self._lock:
            self._members.pop(client, None)

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            members = list(self._members.items())
        return {client: version() for client, version in members}


class SeatBeats:
    """A client's heartbeats as a seat in the host's (`Heartbeats`): it joins the roster when
    started and leaves it when stopped; the host's beat sends them."""

    def __init__(self, roster: Roster, client: str, version: Callable[[], int]) -> None:
        self._roster = roster
        self._client = client
        self._version = version
        self.sent = 0  # the host counts the beats (`HostBeat.members_sent`)
        self.bytes_sent = 0

    def start(self) -> None:
        self._roster.add(self._client, self._version)

    def stop(self, timeout_s: float = 5.0) -> bool:
        self._roster.remove(self._client)
        return True


class HostBeat(Beat):
    """Every `interval_s`: one `HostHeartbeat` per `HOST_HEARTBEAT_MEMBERS` members, then a
    keep-alive of the publishing handles no client used lately. Written by its thread only:
    read the counters after `stop`."""

    ERRORS = (BrokerError,)

    def __init__(
        self,
        publishers: Publishers,
        roster: Roster,
        *,
        job: str,
        host: str,
        interval_s: float,
        probe: str,
        logger: logging.Logger,
    ) -> None:
        super().__init__(f"host-{host}", f"the heartbeats of host {host}", interval_s, logger)
        self._publishers = publishers
        self._roster = roster
        self._job = job
        self._host = host
        self._probe = probe
        self.messages_sent = 0
        self.members_sent = 0
        # Seconds from publish to confirm, of the latest beats (a day's worth at most).
        self.publish_s: deque[float] = deque(maxlen=_BEATS_KEPT)

    def beat(self) -> None:
        members = self._roster.snapshot()
        clients = sorted(members)
        version = max(members.values(), default=0)
        for start in range(0, len(clients), HOST_HEARTBEAT_MEMBERS):
            chunk = {c: members[c] for c in clients[start : start + HOST_HEARTBEAT_MEMBERS]}
            message = HostHeartbeat(self._job, self._host, new_message_id(), version, chunk)
            body = encode(message)
            try:
                options = PublishOptions(message.message_id)
                started = time.monotonic()
                self._publishers.publish(CONTROL_EXCHANGE, self._job, body, options)
                self.publish_s.append(time.monotonic() - started)
            except (BackPressureError, UnroutableError) as exc:
                # The next one will do: a full or missing control queue is the service side's
                # state, not this host's.
                self._log.debug("host %s: heartbeat not delivered: %s", self._host, exc)
                continue
            self.messages_sent += 1
            self.members_sent += len(chunk)
        self._publishers.keep_alive(self._refresh_s, self._probe)

    def end(self) -> None:
        pass  # the handles are the host's; it closes them
