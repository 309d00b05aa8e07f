"""`RedisSchedule`: the `ScheduleStore` over Redis, one list per stream and a set of the
stream names (`broker.keys.schedule_key`, `schedule_streams_key`), all under the job's prefix,
so `delete_job` (and `splitmq clean`) removes them with the job's other keys.

An append is one pipeline (MULTI/EXEC: RPUSH then SADD), one round trip, atomic: a reader
never sees a stream's lines without its name. Like every call it is retried over an outage
(`RedisConnection.call`); a reply lost after the server applied it would append the lines
twice, which a reader tells by the entries' own positions (`Applied.position`, `Folded.version`).
"""

from __future__ import annotations

from collections.abc import Sequence

from broker import keys
from broker.redis_connection import RedisPart, as_text


class RedisSchedule(RedisPart):
    """The schedule streams of a job."""

    def append_schedule(self, job: str, stream: str, lines: Sequence[str]) -> None:
        if not lines:
            return
        key, streams = keys.schedule_key(job, stream), keys.schedule_streams_key(job)
        values = list(lines)

        def append() -> None:
            pipe = self._db.client.pipeline(transaction=True)
            pipe.rpush(key, *values)
            pipe.sadd(streams, stream)
            pipe.execute()

        self._db.call("append_schedule", append)

    def read_schedule(self, job: str) -> dict[str, list[str]]:
        client = self._db.client
        streams = keys.schedule_streams_key(job)
        names = sorted(
            as_text(n) for n in self._db.call("read_schedule", lambda: client.smembers(streams))
        )
        if not names:
            return {}

        def read() -> list[list[bytes]]:
            pipe = client.pipeline(transaction=True)  # one consistent snapshot of all streams
            for name in names:
                pipe.lrange(keys.schedule_key(job, name), 0, -1)
            return list(pipe.execute())

        found = self._db.call("read_schedule", read)
        pairs = zip(names, found, strict=True)
        return {name: [as_text(line) for line in lines] for name, lines in pairs}
