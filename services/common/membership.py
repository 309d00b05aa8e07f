"""A client member as the store keeps it: `client:<id>` with its assignment in the info map.

The coordinator writes these records and the aggregator reads them (cohorts, shards, the
classes behind personalised accuracy), so both go through this one module. Store info values
are strings; `classes` is a comma-separated list of class indices.

A record's `session` names the client process (the incarnation): one that rejoins under its id
between two of the aggregator's polls shows as another process (`same_incarnation`; why it
matters: docs/reliability.md, the row of a cohort member that leaves and rejoins).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from broker.keys import CLIENT_MEMBER_PREFIX
from broker.store import Member, MemberKind, MemberStore

# The Join info key (and member info key) of the client process's session id.
SESSION_KEY = "session"
# The member info key of the session's first seq (`MemberInfo.seq_base`).
SEQ_BASE_KEY = "seq_base"
_SESSION_MAX = 64
# The Join info key naming the client host a client runs on (docs/architecture.md, "Client
# hosts"); its replies then go to that host's queue.
HOST_INFO_KEY = "host"
# The Join info key of that host's queue's name, hidden in the secured mode (services/security/
# hidden.py): the coordinator binds the client's replies to it after checking its shape.
HOST_QUEUE_INFO_KEY = "host_queue"
# Most members one HostHeartbeat may list: a host sends one message per this many clients.
HOST_HEARTBEAT_MEMBERS = 1024


def member_id(client: str) -> str:
    return f"{CLIENT_MEMBER_PREFIX}{client}"


def parse_classes(text: str) -> tuple[int, ...]:
    """`"0,3,7"` → (0, 3, 7); raises ValueError on anything else."""
    text = text.strip()
    if not text:
        return ()
    classes = sorted({int(part) for part in text.split(",")})
    if classes[0] < 0:
        raise ValueError(f"negative class index in {text!r}")
    return tuple(classes)


@dataclass(frozen=True)
class MemberInfo:
    """One live client: where it was assigned and what it holds."""

    client: str
    shard: int
    cut: str
    samples: int
    partition: int
    classes: tuple[int, ...] = ()
    joined_at: float = 0.0
    session: str = ""  # "" in records written before sessions: every such one is alike
    # The session's first SmashedBatch seq, sent in its Welcome: the session numbers its
    # batches contiguously from here (docs/architecture.md, step 2, **Sessions and seqs**).
    # 0: unknown (a record written before seq bases): a reader knows no window then.
    seq_base: int = 0

    @property
    def ready(self) -> bool:
        """Whether it can train: it reported training samples. A client started without a
        partition joins with 0 (it learns its partition from the Welcome, then joins again with
        its count), and one whose partition is empty stays at 0; a round must not count either:
        the RoundStart would name it with 0 samples, which a worker dead-letters (`bad_cohort`).
        """
        return self.samples > 0

    def to_info(self) -> dict[str, str]:
        return {
            "shard": str(self.shard),
            "cut": self.cut,
            "samples": str(self.samples),
            "partition": str(self.partition),
            "classes": ",".join(str(c) for c in self.classes),
            "joined_at": f"{self.joined_at:.3f}",
            SESSION_KEY: self.session,
            SEQ_BASE_KEY: str(self.seq_base),
        }

    @classmethod
    def from_member(cls, member: Member) -> MemberInfo | None:
        """None for a member that is not a client, or whose info is not ours (never raises)."""
        if not member.member_id.startswith(CLIENT_MEMBER_PREFIX):
            return None
        info = member.info
        try:
            return cls(
                client=member.member_id[len(CLIENT_MEMBER_PREFIX) :],
                shard=int(info["shard"]),
                cut=info["cut"],
                samples=int(info["samples"]),
                partition=int(info["partition"]),
                classes=parse_classes(info.get("classes", "")),
                joined_at=float(info.get("joined_at", "0")),
                session=info.get(SESSION_KEY, ""),
                seq_base=max(0, int(info.get(SEQ_BASE_KEY, "0"))),
            )
        except (KeyError, ValueError):
            return None


def session_of(info: Mapping[str, str]) -> str | None:
    """The session a Join's info names (`info["session"]`), None if absent or unusable."""
    text = info.get(SESSION_KEY, "").strip()
    return text if 0 < len(text) <= _SESSION_MAX and text.isprintable() else None


def same_incarnation(before: MemberInfo, now: MemberInfo | None) -> bool:
    """Whether `now` (None: gone) is still the client process that `before` recorded."""
    return now is not None and now.session == before.session


def client_members(store: MemberStore, job: str) -> dict[str, MemberInfo]:
    """Live clients by id (members with unreadable info are left out); no other kind is read."""
    members = store.live_members(job, MemberKind.CLIENT).values()
    infos = (MemberInfo.from_member(member) for member in members)
    return {info.client: info for info in infos if info is not None}
