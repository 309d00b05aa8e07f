"""`RedisMembers`: the `MemberStore` over Redis (membership, leases, how a job ended).

Members of each kind are a sorted set (member -> expiry) beside a hash of their info
(`broker.keys`); every step over both, and every lease step, is one Lua script
(`broker.redis_scripts`) or one MULTI/EXEC.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence

from broker import keys, redis_scripts
from broker.errors import StoreError
from broker.redis_connection import RedisConnection, RedisPart, as_text, byte_hash, millis
from broker.store import JobStatus, Member, MemberKind
from broker.store_codec import str_map


def encode_info(info: Mapping[str, str]) -> str:
    return json.dumps(str_map("member info", info), sort_keys=True)


def decode_info(raw: bytes | str) -> dict[str, str]:
    try:
        obj = json.loads(raw)
    except ValueError as exc:
        raise StoreError(f"malformed member info {raw!r}: {exc}") from exc
    if not isinstance(obj, dict):
        raise StoreError(f"malformed member info {raw!r}")
    return {str(k): str(v) for k, v in obj.items()}


def _kind_keys(job: str, kind: MemberKind) -> list[str]:
    return [keys.members_key(job, kind), keys.members_info_key(job, kind)]


def kind_slots(job: str, member_ids: Sequence[str]) -> tuple[list[str], list[str | int]]:
    """The KEYS and the (slot, member) ARGV pairs of a script over `member_ids` of any kinds
    (redis_scripts.RENEW_MEMBERS): each kind's pair of keys once, in the order first met."""
    slots: dict[MemberKind, int] = {}
    script_keys: list[str] = []
    args: list[str | int] = []
    for member_id in member_ids:
        kind = keys.member_kind(member_id)
        if kind not in slots:
            slots[kind] = len(slots) + 1
            script_keys += _kind_keys(job, kind)
        args += [slots[kind], member_id]
    return script_keys, args


class RedisMembers(RedisPart):
    """Who is in a job (each with a TTL), its leases, and how it ended."""

    def __init__(self, db: RedisConnection) -> None:
        super().__init__(db)
        self._heartbeat = db.script(redis_scripts.HEARTBEAT)
        self._live_members = db.script(redis_scripts.LIVE_MEMBERS)
        self._renew_members = db.script(redis_scripts.RENEW_MEMBERS)
        self._member_ttls = db.script(redis_scripts.MEMBER_TTLS)
        self._member = db.script(redis_scripts.MEMBER)
        self._acquire_lease = db.script(redis_scripts.ACQUIRE_LEASE)
        self._release_lease = db.script(redis_scripts.RELEASE_LEASE)

    # --- membership ---------------------------------------------------------------------------
    def heartbeat(
        self, job: str, member_id: str, ttl_s: float, info: Mapping[str, str] | None = None
    ) -> None:
        keys.validate_name("member id", member_id)
        args: list[str | int] = [
            member_id,
            millis(ttl_s),
            "" if info is None else encode_info(info),
        ]
        script_keys = _kind_keys(job, keys.member_kind(member_id))
        self._db.call("heartbeat", lambda: self._heartbeat(keys=script_keys, args=args))

    def renew_members(self, job: str, member_ids: Sequence[str], ttl_s: float) -> list[bool]:
        if not member_ids:
            return []
        script_keys, slots = kind_slots(job, member_ids)
        args: list[str | int] = [millis(ttl_s), *slots]
        # Idempotent on a retry: a renewal renews again; one pruned by the first try was dead.
        live = self._db.call(
            "renew_members", lambda: self._renew_members(keys=script_keys, args=args)
        )
        return [bool(flag) for flag in live]

    def member(self, job: str, member_id: str) -> Member | None:
        script_keys = _kind_keys(job, keys.member_kind(member_id))
        found = self._db.call("member", lambda: self._member(keys=script_keys, args=[member_id]))
        if not found:
            return None
        return Member(member_id, float(found[0]), decode_info(found[1]))

    def remove_member(self, job: str, member_id: str) -> None:
        zset, info = _kind_keys(job, keys.member_kind(member_id))

        def remove() -> None:
            # Built anew on every try: a failed `execute` empties the pipeline.
            pipe = self._db.client.pipeline(transaction=True)
            pipe.zrem(zset, member_id)
            pipe.hdel(info, member_id)
            pipe.execute()

        self._db.call("remove_member", remove)

    def live_members(self, job: str, kind: MemberKind | None = None) -> dict[str, Member]:
        kinds = list(MemberKind) if kind is None else [kind]
        script_keys = [key for k in kinds for key in _kind_keys(job, k)]
        flat = self._db.call("live_members", lambda: self._live_members(keys=script_keys))
        members = {}
        for i in range(0, len(flat), 3):
            member_id = as_text(flat[i])
            members[member_id] = Member(member_id, float(flat[i + 1]), decode_info(flat[i + 2]))
        return members

    def member_ttls(self, job: str, member_ids: Sequence[str]) -> list[float | None]:
        if not member_ids:
            return []
        script_keys, args = kind_slots(job, member_ids)
        # Idempotent on a retry: one pruned by the first try reads as gone again.
        left = self._db.call("member_ttls", lambda: self._member_ttls(keys=script_keys, args=args))
        return [float(ttl) if ttl else None for ttl in left]

    # --- leases -------------------------------------------------------------------------------
    def acquire_lease(self, job: str, name: str, owner: str, ttl_s: float) -> bool:
        keys.validate_name("lease owner", owner)
        key, ttl_ms = keys.lease_key(job, name), millis(ttl_s)
        taken = self._db.call(
            "acquire_lease", lambda: self._acquire_lease(keys=[key], args=[owner, ttl_ms])
        )
        return bool(taken)

    def release_lease(self, job: str, name: str, owner: str) -> None:
        key = keys.lease_key(job, name)
        self._db.call("release_lease", lambda: self._release_lease(keys=[key], args=[owner]))

    # --- how the job ended --------------------------------------------------------------------
    def set_job_status(self, job: str, status: JobStatus) -> None:
        key = keys.status_key(job)

        def replace() -> None:
            # One MULTI/EXEC: a reader never sees a new state with an old detail.
            pipe = self._db.client.pipeline(transaction=True)
            pipe.delete(key)
            pipe.hset(key, mapping={"state": status.state, "detail": status.detail})
            pipe.execute()

        self._db.call("set_job_status", replace)

    def job_status(self, job: str) -> JobStatus | None:
        key = keys.status_key(job)
        fields = byte_hash(self._db.call("job_status", lambda: self._db.client.hgetall(key)))
        if not fields:
            return None
        try:
            return JobStatus(as_text(fields[b"state"]), as_text(fields.get(b"detail", b"")))
        except (KeyError, ValueError) as exc:
            raise StoreError(f"malformed job status {key}: {exc!r}") from exc

    def clear_job_status(self, job: str) -> None:
        key = keys.status_key(job)
        self._db.call("clear_job_status", lambda: self._db.client.delete(key))
