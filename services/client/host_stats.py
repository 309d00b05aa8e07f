"""What a client host's clients did, summed over their sessions, and what the host itself did
(`HostStats`; `splitmq clients --stats-file` writes it as JSON).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from services.client.hostlink import DispatchStats
from services.client.stats import ClientStats


@dataclass
class HostStats:
    """What a host's clients did, summed over their sessions, and what the host itself did."""

    clients: int = 0
    sessions: int = 0  # online sessions started (a client back online starts another)
    finished: bool = False  # a client was told the job is over
    job_status: str = ""
    per_client: dict[str, ClientStats] = field(default_factory=dict)
    # Each ended session in the order they ended: (client, its stats).
    per_session: list[tuple[str, ClientStats]] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)  # client -> its last session's error
    dispatch: DispatchStats = field(default_factory=DispatchStats)
    beat_messages: int = 0
    beat_members: int = 0
    models_built: int = 0
    join_s: list[float] = field(default_factory=list)  # each welcomed session's wait
    beat_publish_s: list[float] = field(default_factory=list)  # each HostHeartbeat's confirm

    def as_json(self) -> dict[str, object]:
        """For `--stats-file`: per client its counters, and the host's own."""
        return {
            "clients": self.clients,
            "sessions": self.sessions,
            "finished": self.finished,
            "job_status": self.job_status,
            "total": asdict(self.total()),
            "per_client": {
                c: {
                    "batches_sent": one.batches_sent,
                    "replies_received": one.replies_received,
                    "rounds": one.rounds,
                    "rounds_aborted": one.rounds_aborted,
                    "joins_sent": one.joins_sent,
                    "republished": one.republished,
                    "dead_lettered": one.dead_lettered,
                }
                for c, one in sorted(self.per_client.items())
            },
            "failed": self.failed,
            "dispatch": asdict(self.dispatch),
            "beat_messages": self.beat_messages,
            "beat_members": self.beat_members,
            "models_built": self.models_built,
            "join_s": self.join_s,
            "beat_publish_s": self.beat_publish_s,
        }

    def total(self) -> ClientStats:
        out = ClientStats()
        for stats in self.per_client.values():
            out.add(stats)
        return out
