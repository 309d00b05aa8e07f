"""`RedisWeightStore`: the `WeightStore` over Redis (redis-py), key schema in `broker.keys`.

The store is its four protocols' parts on one `RedisConnection` (`broker.redis_connection`,
which says how errors, outages and Sentinel failovers are handled): `RedisVersions`,
`RedisCheckpoints`, `RedisMembers`, `RedisSchedule`. Every multi-key step that must be atomic
is one Lua script (`broker.redis_scripts`) or one MULTI/EXEC.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from broker import keys
from broker.redis_checkpoints import RedisCheckpoints
from broker.redis_connection import NO_RETRY, RedisConnection, RedisStoreOptions, RetryPolicy
from broker.redis_members import RedisMembers
from broker.redis_schedule import RedisSchedule
from broker.redis_server import RedisServerInfo, server_info
from broker.redis_versions import RedisVersions
from broker.store import (
    CheckpointStore,
    MemberStore,
    ScheduleStore,
    VersionStore,
    WeightStore,
)

# The store's options come with it: callers build them from here.
__all__ = ["NO_RETRY", "RedisStoreOptions", "RedisWeightStore", "RetryPolicy"]

_SCAN_COUNT = 500
_DELETE_BATCH = 500


class RedisWeightStore(RedisVersions, RedisCheckpoints, RedisMembers, RedisSchedule):
    """Thread-safe (redis-py's connection pool); one instance per process is enough."""

    def __init__(
        self,
        url: str,
        options: RedisStoreOptions | None = None,
        *,
        logger: logging.Logger | None = None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        super().__init__(
            RedisConnection(
                url,
                options or RedisStoreOptions(),
                logger=logger or logging.getLogger("splitmq.store"),
                clock=clock,
                sleep=sleep,
            )
        )

    def delete_job(self, job: str) -> None:
        pattern = keys.job_pattern(job)
        client = self._db.client

        def delete() -> None:
            found = list(client.scan_iter(match=pattern, count=_SCAN_COUNT))
            for i in range(0, len(found), _DELETE_BATCH):
                # UNLINK frees big blobs off the server's main thread.
                client.unlink(*found[i : i + _DELETE_BATCH])

        self._db.call("delete_job", delete)

    def server_info(self) -> RedisServerInfo:
        """Version, a write/read probe, persistence and eviction settings, with problems."""
        return self._db.call("server_info", lambda: server_info(self._db))


if TYPE_CHECKING:  # mypy proves each part serves its protocol, and the store all of them

    def _conforms(
        store: RedisWeightStore,
        versions: RedisVersions,
        checkpoints: RedisCheckpoints,
        members: RedisMembers,
        schedule: RedisSchedule,
    ) -> tuple[WeightStore, VersionStore, CheckpointStore, MemberStore, ScheduleStore]:
        return store, versions, checkpoints, members, schedule
