"""A role start waits `START_WAIT_S` for its broker, not the outage budget, and a signal ends
the wait at once (issue 18, item 6). No server needed: nobody listens on the ports used."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from broker.errors import BrokerUnavailableError
from services.common.backends import Backends
from services.config.settings import BrokerSettings, StoreSettings
from services.runtime.doctor import StartInterrupted, check_services


def closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
    return port


def unreachable() -> Backends:
    # The default outage budget of a running role: 300 s.
    broker = BrokerSettings(
        kind="rabbitmq",
        amqp_url=f"amqp://guest:guest@127.0.0.1:{closed_port()}/%2F",
        reconnect_max_backoff_s=0.2,
    )
    assert broker.reconnect_give_up_s == 300.0
    return Backends(broker, StoreSettings(kind="redis"))


def test_start_gives_up_after_its_own_wait_not_the_outage_budget() -> None:
    started = time.monotonic()
    with pytest.raises(BrokerUnavailableError, match="RabbitMQ unreachable at amqp://guest@"):
        check_services(unreachable(), "j", store=True, stop=threading.Event(), wait_s=1.0)
    assert time.monotonic() - started < 20  # 1 s of waiting; generous for a loaded machine


def test_a_signal_ends_the_wait_at_once() -> None:
    stop = threading.Event()
    attempting = threading.Timer(0.3, stop.set)
    attempting.start()
    started = time.monotonic()
    try:
        with pytest.raises(StartInterrupted):
            check_services(unreachable(), "j", store=True, stop=stop, wait_s=120.0)
    finally:
        attempting.cancel()
    assert time.monotonic() - started < 20  # not the 120 s wait
