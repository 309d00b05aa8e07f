"""A closed round's `VersionRecord`, from the clients' reported metrics and the evaluation.

Clients report in `WeightsUpdate.metrics` (names below); the aggregator adds what it measured
itself: the round's wall time and the bytes of the weights it exchanged with the clients
(assignments out, updates in), which a client cannot count for the update it is still writing.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from broker.messages import ConfigValue
from services.aggregator.evaluation import VersionEval
from services.algorithms.base import ClientUpdate
from services.report.records import VersionRecord

# Accepted spellings of each client metric, first match wins.
TRAIN_LOSS = ("train_loss", "loss")
TRAIN_ACCURACY = ("train_accuracy", "train_acc", "accuracy")
BYTES_UP = ("bytes_up", "bytes_sent")
BYTES_DOWN = ("bytes_down", "bytes_received")
COMPUTE_S = ("compute_s",)
# Samples actually trained this round; `WeightsUpdate.samples` is |D_k|, the averaging weight,
# which max_steps_per_round may cap far below.
TRAIN_SAMPLES = ("train_samples",)

NAN = float("nan")


def metric(metrics: Mapping[str, float], names: Sequence[str]) -> float | None:
    for name in names:
        value = metrics.get(name)
        if value is not None:
            return float(value)
    return None


def sample_weighted(updates: Sequence[ClientUpdate], names: Sequence[str]) -> float:
    """Mean of a metric over the clients that report it, weighted by their samples."""
    pairs = [(u.samples, metric(u.metrics, names)) for u in updates]
    known = [(s, v) for s, v in pairs if v is not None and v == v]
    total = sum(s for s, _ in known)
    return sum(s * v for s, v in known) / total if total else NAN


def trained(update: ClientUpdate) -> float:
    reported = metric(update.metrics, TRAIN_SAMPLES)
    return float(update.samples) if reported is None else reported


def summed(updates: Sequence[ClientUpdate], names: Sequence[str]) -> float:
    return sum(metric(u.metrics, names) or 0.0 for u in updates)


@dataclass(frozen=True)
class RoundTraffic:
    """What the aggregator measured during one round."""

    round_s: float  # round opened → last update in
    update_bytes: int
    assignment_bytes: int
    late_updates: int


def build_record(
    *,
    version: int,
    round_index: int,
    elapsed_s: float,
    updates: Sequence[ClientUpdate],
    traffic: RoundTraffic,
    evaluation: VersionEval | None,
) -> VersionRecord:
    samples = int(sum(trained(u) for u in updates))
    extra: dict[str, float] = {"round_s": traffic.round_s}
    compute = [metric(u.metrics, COMPUTE_S) for u in updates]
    if all(c is not None and c > 0 for c in compute) and compute:
        # Sum of the clients' own rates: what the cohort could do without waiting on anyone.
        extra["client_samples_per_s"] = sum(
            trained(u) / c for u, c in zip(updates, compute, strict=True) if c
        )
    if evaluation is not None:
        extra["test_samples"] = float(evaluation.test_samples)
    return VersionRecord(
        version=version,
        round=round_index,
        elapsed_s=elapsed_s,
        participants=len(updates),
        global_accuracy=evaluation.global_accuracy if evaluation else NAN,
        global_loss=evaluation.global_loss if evaluation else NAN,
        personal_accuracy=evaluation.personal_accuracy if evaluation else NAN,
        train_loss=sample_weighted(updates, TRAIN_LOSS),
        train_accuracy=sample_weighted(updates, TRAIN_ACCURACY),
        samples=samples,
        samples_per_s=samples / traffic.round_s if traffic.round_s > 0 else 0.0,
        bytes_up=int(summed(updates, BYTES_UP)) + traffic.update_bytes,
        bytes_down=int(summed(updates, BYTES_DOWN)) + traffic.assignment_bytes,
        late_updates=traffic.late_updates,
        extra=extra,
    )


def event_data(record: VersionRecord) -> dict[str, ConfigValue]:
    """The `version_published` event's payload (NaN metrics, i.e. not evaluated, left out)."""
    data: dict[str, ConfigValue] = {
        "round": record.round,
        "participants": record.participants,
        "samples": record.samples,
        "late_updates": record.late_updates,
    }
    for name in ("global_accuracy", "global_loss", "personal_accuracy", "train_loss"):
        value = float(getattr(record, name))
        if value == value:
            data[name] = value
    return data
