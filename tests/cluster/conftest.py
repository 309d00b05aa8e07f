"""The local cluster (scripts/cluster.sh) as a session fixture.

A cluster that is already up (`cluster.sh status` exits 0) is used as it is and left running;
otherwise the fixture brings it up and takes it down at the end of the session. Without the
Debian RabbitMQ and Redis packages the cluster tests skip locally and fail under CI=true, as the
single-service tests do.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from benchmarks.cluster import LocalCluster, available


@pytest.fixture(scope="session")
def cluster() -> Iterator[LocalCluster]:
    if not available():
        message = "the local cluster needs the rabbitmq-server and redis-server packages"
        if os.environ.get("CI", "").lower() in {"1", "true", "yes"}:
            pytest.fail(f"{message} (CI=true: a missing service is a failure, not a skip)")
        pytest.skip(f"{message}; install them or set CI=true to make this a failure")
    local = LocalCluster()
    started = not local.is_up()
    if started:
        local.up()
    yield local
    if started:
        local.down()
