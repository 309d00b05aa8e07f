"""Shared fixtures: real-service discovery and unique job names.

Real RabbitMQ/Redis tests skip locally when a service is down, but fail under CI=true: a
missing service there is a broken environment, not a reason to pass.
"""

from __future__ import annotations

import os
import socket
import uuid
from collections.abc import Iterator
from urllib.parse import urlparse

import pytest

DEFAULT_AMQP_URL = "amqp://guest:guest@127.0.0.1:5672/%2F"
DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"


def _reachable(url: str, default_port: int) -> bool:
    parsed = urlparse(url)
    address = (parsed.hostname or "127.0.0.1", parsed.port or default_port)
    try:
        with socket.create_connection(address, 2):
            return True
    except OSError:
        return False


def _require(url: str, default_port: int, what: str) -> str:
    if _reachable(url, default_port):
        return url
    message = f"{what} is not reachable at {url}"
    if os.environ.get("CI", "").lower() in {"1", "true", "yes"}:
        pytest.fail(f"{message} (CI=true: a missing service is a failure, not a skip)")
    pytest.skip(f"{message}; start it or set CI=true to make this a failure")
    raise AssertionError("unreachable")


@pytest.fixture(scope="session")
def amqp_url() -> str:
    return _require(os.environ.get("SPLITMQ_AMQP_URL", DEFAULT_AMQP_URL), 5672, "RabbitMQ")


@pytest.fixture(scope="session")
def redis_url() -> str:
    return _require(os.environ.get("SPLITMQ_REDIS_URL", DEFAULT_REDIS_URL), 6379, "Redis")


@pytest.fixture
def job() -> str:
    """A job name no other test uses, so tests on shared real services never collide."""
    return f"t{uuid.uuid4().hex[:12]}"


@pytest.fixture(scope="session")
def data_dir() -> str:
    """Where the full datasets live (SPLITMQ_TEST_DATA_DIR, default ../shared/data)."""
    here = os.path.dirname(os.path.abspath(__file__))
    default = os.path.normpath(os.path.join(here, "..", "..", "shared", "data"))
    path = os.environ.get("SPLITMQ_TEST_DATA_DIR", default)
    if not os.path.isdir(path):
        pytest.fail(f"test datasets not found at {path}; set SPLITMQ_TEST_DATA_DIR")
    return path


@pytest.fixture
def one_torch_thread() -> Iterator[None]:
    """torch on one intra-op thread for the test: the roles of a job are threads already, and
    on a busy 2-core host spinning intra-op threads slowed steps many times over."""
    import torch  # here, not at the top: collecting tests that never train must not pay for it

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# Tests that kill servers and time a failover against Sentinel's and RabbitMQ's own clocks
# (down-after 1 s, a node's boot), and the flood test, which compares round times with and
# without a flooder and so measures the flood's CPU cost, not that of whatever test another
# xdist worker runs beside it: `scripts/test.sh` runs them alone, after the parallel phase,
# because their deadlines assume the machine's cores, as a deployment would have them.
EXCLUSIVE = (
    "tests/cluster/",
    "tests/integration/test_redis_sentinel.py",
    "tests/integration/test_flood_rabbitmq.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Groups for pytest-xdist's `--dist loadgroup`: a file's tests run on one worker (its
    module-scoped fixtures, such as a Sentinel group on fixed ports, exist once), and the two
    files that kill and restart nodes of the one local cluster share a group. The `exclusive`
    marker goes on the files of `EXCLUSIVE`."""
    for item in items:
        path = item.nodeid.split("::", 1)[0]
        group = "cluster" if path.startswith("tests/cluster/") else path
        item.add_marker(pytest.mark.xdist_group(group))
        if path.startswith(EXCLUSIVE):
            item.add_marker(pytest.mark.exclusive)
