"""A role's first contact with its servers, before it starts anything else.

A role process waits out a brief outage at start (RabbitMQ or Redis restarting beside it), but
not the whole outage budget of a running role (`reconnect_give_up_s`, 300 s by default): a
wrong port or host should fail within `START_WAIT_S`, and a refused password or a bad URL at
once, each in one line. A signal ends the wait (a running role's reconnects know nothing of
the stop event, so without this SIGTERM went unheard for the whole budget).
"""

from __future__ import annotations

import threading
from contextlib import closing

from services.common.backends import Backends

# Long enough for a broker or Redis restarting beside the role; compose starts roles only
# once both are healthy and restarts a role that failed, so a longer wait buys nothing.
START_WAIT_S = 30.0


class StartInterrupted(Exception):
    """A signal (the stop event) arrived while waiting for the broker or store."""


def check_services(
    backends: Backends,
    job: str,
    *,
    store: bool,
    stop: threading.Event,
    wait_s: float = START_WAIT_S,
) -> None:
    """Connect to the broker (and, if `store`, read `job`'s version from the store) once,
    waiting at most `wait_s` for each; raise what the broker layer raises
    (`BrokerUnavailableError`, `BrokerAuthError`, `ConnectionSettingsError`, their store
    twins) or `StartInterrupted`."""

    def sleep(seconds: float) -> None:
        if stop.wait(seconds):
            raise StartInterrupted

    broker_wait = min(wait_s, backends.broker_settings.reconnect_give_up_s)
    backends.open_broker("", give_up_after=broker_wait, sleep=sleep).close()
    if not store:
        return
    give_up_after = min(wait_s, backends.store_settings.retry_for_s)
    with closing(backends.open_store(give_up_after=give_up_after, sleep=sleep)) as probe:
        probe.current_version(job)
