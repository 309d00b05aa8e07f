"""`RedisCheckpoints`: the `CheckpointStore` over Redis, one hash per shard (`broker.keys`).

A save is one Lua script (`redis_scripts.SAVE_CHECKPOINT`): a whole replace, which with a
holder also checks, in the same step, that the writer still holds the shard's lease.
"""

from __future__ import annotations

from typing import Any

from broker import keys, redis_scripts
from broker.errors import StoreError
from broker.redis_connection import RedisConnection, RedisPart, as_text, byte_hash
from broker.store import Checkpoint
from broker.store_codec import decode_checkpoint, encode_checkpoint, lease_not_held


class RedisCheckpoints(RedisPart):
    """The latest checkpoint of each shard of a job."""

    def __init__(self, db: RedisConnection) -> None:
        super().__init__(db)
        self._save_checkpoint = db.script(redis_scripts.SAVE_CHECKPOINT)

    def save_checkpoint(
        self, job: str, checkpoint: Checkpoint, *, holder: tuple[str, str] | None = None
    ) -> None:
        data, sha256, meta = encode_checkpoint(checkpoint)
        args: list[bytes | str | int] = [data, sha256, int(checkpoint.applied), meta]
        script_keys = [keys.checkpoint_key(job, checkpoint.shard)]
        if holder is not None:
            script_keys.append(keys.lease_key(job, holder[0]))
            args.append(holder[1])

        def save() -> Any:
            # A replace, so retried when short of replicas; with `holder` the script itself
            # refuses a writer that lost the lease (during an outage, say).
            what = f"checkpoint of shard {checkpoint.shard} of job {job}"
            return self._db.replicated(
                self._save_checkpoint, script_keys, args, what, lambda result: result != -1
            )

        saved = self._db.call("save_checkpoint", save)
        if holder is not None and saved == -1:  # the script returns -1 (an integer) or a time
            raise lease_not_held(checkpoint.shard, holder)

    def load_checkpoint(self, job: str, shard: int) -> Checkpoint | None:
        key = keys.checkpoint_key(job, shard)
        fields = byte_hash(self._db.call("load_checkpoint", lambda: self._db.client.hgetall(key)))
        if not fields:
            return None
        try:
            data, sha, meta = fields[b"weights"], as_text(fields[b"sha256"]), fields[b"meta"]
            applied, saved_at = int(fields[b"applied"]), float(fields[b"saved_at"])
        except (KeyError, ValueError) as exc:
            raise StoreError(f"malformed checkpoint {key}: {exc!r}") from exc
        return decode_checkpoint(key, shard, applied, data, sha, meta, saved_at)
