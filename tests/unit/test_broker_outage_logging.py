"""A RabbitMQ outage logs one warning, however many attempts it takes (issue 18, item 6).

No server needed: a port nobody listens on is an outage that never ends.
"""

from __future__ import annotations

import logging
import socket

import pytest

from broker.errors import BrokerUnavailableError
from broker.rabbitmq import RabbitMQBroker, RabbitMQOptions


def closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
    return port


def test_unreachable_broker_logs_one_warning_for_all_attempts(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="splitmq.broker")
    options = RabbitMQOptions(
        give_up_after=1.0, reconnect_initial_delay=0.02, reconnect_max_delay=0.05
    )
    url = f"amqp://guest:guest@127.0.0.1:{closed_port()}/%2F"

    with pytest.raises(BrokerUnavailableError, match=r"after (\d+) attempt") as excinfo:
        RabbitMQBroker(url, options)

    assert "after 1 attempt" not in str(excinfo.value)  # it did retry, several times
    ours = [r for r in caplog.records if r.name == "splitmq.broker"]
    assert len(ours) == 1, [r.getMessage() for r in ours]
    (warning,) = ours
    assert warning.levelno == logging.WARNING and not warning.exc_info
    assert "cannot reach RabbitMQ at 127.0.0.1:" in warning.getMessage()
    assert "retrying for up to 1 s" in warning.getMessage()
