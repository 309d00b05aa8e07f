"""What a client did, for logs, tests and the embedded runner's summary."""

from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass
class ClientStats:
    """Counters of one client's run; `run` returns them (only the client's thread writes)."""

    rounds: int = 0  # rounds whose WeightsUpdate was published
    rounds_aborted: int = 0
    batches_sent: int = 0  # distinct SmashedBatches (republishes not counted)
    republished: int = 0  # SmashedBatches sent again after reply_timeout_s
    replies_received: int = 0  # GradientReplies applied or tallied
    duplicates_dropped: int = 0  # GradientReplies for a seq no longer awaited
    stale_replies: int = 0  # "stale" answers to a republished copy of the awaited seq
    gone_replies: int = 0  # "gone" answers: the awaited seq was applied, its gradient lost
    backpressure_retries: int = 0
    unroutable_retries: int = 0
    errors_received: int = 0  # Error replies (round_closed...)
    dead_lettered: int = 0  # deliveries on the reply queue that failed validation
    heartbeats_sent: int = 0
    joins_sent: int = 0
    bytes_up: int = 0
    bytes_down: int = 0
    finished: bool = False  # the job told this client it is over
    stale_rounds: int = 0  # async mode: local rounds dropped because a worker said too_stale
    job_status: str = ""  # how the job ended, from its dismissal: "finished", "failed: ..."
    join_s: float = 0.0  # from the first Join to the Welcome (0: never welcomed)

    def add(self, one: ClientStats) -> None:
        """Add `one`'s counters to these; a flag or status is kept once set."""
        for f in fields(ClientStats):
            value = getattr(one, f.name)
            if isinstance(value, bool | str):
                if value:
                    setattr(self, f.name, value)
            else:
                setattr(self, f.name, getattr(self, f.name) + value)
