"""What the aggregator records per version, and where it sends it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

# The personalised-FL papers' metric (Sub-FedAvg's, FedDeper's), an `extra` of the records:
# each client's own model after its local training, on its local test set, averaged over all
# clients that have trained (their latest reports).
OWN_MODEL_ACCURACY = "own_model_accuracy"


@dataclass(frozen=True)
class VersionRecord:
    """Metrics of one published version (one closed round in sync mode)."""

    version: int
    # Counted from 1, as everywhere a person reads it (console, logs, metrics files, plots,
    # the dashboard); the messages' `round` field is the 0-based index of that round.
    round: int
    elapsed_s: float  # since the job started
    participants: int  # clients whose updates went into this version
    global_accuracy: float  # full model on the whole test set
    global_loss: float
    personal_accuracy: float  # mean over clients of their model on their local test set
    train_loss: float  # sample-weighted mean of the clients' reported training loss
    train_accuracy: float
    samples: int  # training samples processed this round
    samples_per_s: float
    bytes_up: int  # clients → service (smashed data, updates)
    bytes_down: int  # service → clients (gradients, weights)
    late_updates: int = 0
    extra: dict[str, float] = field(default_factory=dict)


class MetricsSink(Protocol):
    def record(self, record: VersionRecord) -> None: ...

    def finish(self, status: str) -> None:
        """The job ended (`status`: "finished", "stopped", "failed: ...")."""
        ...


@dataclass
class ListSink:
    """Keeps records in memory (tests, the embedded runner's summary)."""

    records: list[VersionRecord] = field(default_factory=list)
    status: str = ""

    def record(self, record: VersionRecord) -> None:
        self.records.append(record)

    def finish(self, status: str) -> None:
        self.status = status
