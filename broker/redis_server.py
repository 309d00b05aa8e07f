"""What `splitmq doctor` learns of the Redis behind the store (`server_info`): its version, a
write/read probe, persistence and eviction settings, replication and, with Sentinel, what each
sentinel says, with the problems found."""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import redis

from broker import keys
from broker.redis_connection import RedisConnection, as_text


@dataclass(frozen=True)
class RedisServerInfo:
    """What `splitmq doctor` reports about the Redis behind the store."""

    version: str
    can_write: bool
    can_read: bool
    aof_enabled: bool
    problems: tuple[str, ...]
    # appendfsync ("always", "everysec", "no"; "unknown" where CONFIG is not allowed).
    aof_fsync: str = "unknown"
    # The primary's address, and its replicas as "host:port" (online, lag N s) from its INFO.
    primary: str = ""
    replicas: tuple[str, ...] = ()
    # With Sentinel: each sentinel as "host:port" with what it says ("ok", or the error).
    sentinels: tuple[str, ...] = ()


def server_info(db: RedisConnection) -> RedisServerInfo:
    """Version, a write/read probe, persistence and eviction settings, with problems. redis
    errors escape: run it through `db.call`."""
    info: Any = db.client.info
    server, persistence, memory = info("server"), info("persistence"), info("memory")
    can_write, can_read, probe_problem = _probe(db.client)
    try:
        found: Any = db.client.config_get("appendfsync")
    except redis.ResponseError:  # CONFIG renamed away or denied by an ACL (managed Redis)
        found = {}
    fsync = {as_text(k): as_text(v) for k, v in dict(found).items()}.get("appendfsync", "unknown")
    problems = [] if probe_problem is None else [probe_problem]
    aof_enabled = bool(int(persistence.get("aof_enabled", 0)))
    aof_status = str(persistence.get("aof_last_write_status", "unknown"))
    policy = str(memory.get("maxmemory_policy", "unknown"))
    if not aof_enabled:
        problems.append("AOF is off: a Redis crash loses recently published versions")
    elif aof_status != "ok":
        problems.append(f"AOF last write status is {aof_status}")
    elif fsync in ("everysec", "no"):
        problems.append(
            f"appendfsync {fsync}: a crash can lose acknowledged writes (announced versions, "
            "checkpoints whose batches are acked); use appendfsync always"
        )
    if int(memory.get("maxmemory", 0)) and policy != "noeviction":
        problems.append(f"maxmemory-policy {policy} may evict weights or leases; use noeviction")
    primary, replicas = _replication(db, info("replication"), problems)
    sentinels = _sentinels(db, primary, problems)
    version = str(server.get("redis_version", "unknown"))
    return RedisServerInfo(
        version,
        can_write,
        can_read,
        aof_enabled,
        tuple(problems),
        fsync,
        primary,
        replicas,
        sentinels,
    )


def _replication(
    db: RedisConnection, replication: Mapping[str, Any], problems: list[str]
) -> tuple[str, tuple[str, ...]]:
    """The address this client writes to and its replicas from INFO replication."""
    kwargs = db.client.connection_pool.connection_kwargs
    address = getattr(db.client.connection_pool, "master_address", None)
    host, port = address or (kwargs.get("host"), kwargs.get("port"))
    replicas, online = [], 0
    for i in range(int(replication.get("connected_slaves", 0))):
        r = replication.get(f"slave{i}", {})
        online += r.get("state") == "online"
        replicas.append(f"{r.get('ip')}:{r.get('port')} ({r.get('state')}, lag {r.get('lag')} s)")
    role = str(replication.get("role", "unknown")).replace("slave", "replica")
    if role != "master":
        problems.append(f"{host}:{port} is a {role}, not the primary: writes will fail")
    need = db.options.min_replicas
    if online < need:
        problems.append(
            f"store.min_replicas = {need} but the primary has {online} replicas online: "
            "version publishes and checkpoints wait for replicas, then fail"
        )
    elif db.sentinel is not None and not online:
        problems.append("no replica online: Sentinel has nothing to promote")
    return f"{host}:{port}", tuple(replicas)


def _sentinels(db: RedisConnection, primary: str, problems: list[str]) -> tuple[str, ...]:
    """What each sentinel says of `master_name`; problems for those that disagree."""
    if db.sentinel is None:
        return ()
    name, found = db.options.master_name, []
    for client in db.sentinel.sentinels:
        kwargs = client.connection_pool.connection_kwargs
        where = f"{kwargs.get('host')}:{kwargs.get('port')}"
        try:
            state: Any = client.sentinel_master(name)
        except redis.RedisError as exc:
            found.append(f"{where} failed: {exc}")
            problems.append(f"sentinel {where} does not answer for {name!r}: {exc}")
            continue
        says = f"{state.get('ip')}:{state.get('port')}"
        found.append(
            f"{where} ok (primary {says}, quorum {state.get('quorum')}, "
            f"{state.get('num-other-sentinels')} other sentinels)"
        )
        if says != primary:
            problems.append(f"sentinel {where} names {says} as the primary, not {primary}")
    if len(found) < 3:
        problems.append(
            f"{len(found)} sentinels: a failover needs a majority, so one lost sentinel "
            "can block it (run three or more)"
        )
    return tuple(found)


def _probe(client: redis.Redis) -> tuple[bool, bool, str | None]:
    """(can write, can read, problem) of a scratch key written, read back and deleted."""
    token = uuid.uuid4().hex
    key = keys.probe_key(token)
    wrote = False
    try:
        client.set(key, token, px=10_000)
        wrote = True
        value: Any = client.get(key)
        client.delete(key)
    except redis.ResponseError as exc:  # e.g. READONLY replica, MISCONF, OOM
        return wrote, False, f"probe {'read' if wrote else 'write'} failed: {exc}"
    if value != token.encode():
        return True, False, "probe read returned a different value"
    return True, True, None
