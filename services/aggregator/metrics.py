"""A closed round's `VersionRecord`, from the clients' reported metrics and the evaluation.

Clients report in `WeightsUpdate.metrics` (names below); the aggregator adds what it measured
itself: the round's wall time and the bytes of the weights it exchanged with the clients
(assignments out, updates in), which a client cannot count for the update it is still writing.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

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
ROUND_WALL_S = ("round_wall_s",)
# Accuracy of the client's own model on its local test set (see `client_mean`).
PERSONAL_ACCURACY = ("personal_accuracy",)

NAN = float("nan")
# A client metric `report.<name>` (an algorithm's own per-client figure, e.g. Sub-FedAvg's
# parameter reduction) becomes the extra columns `<name>` (mean over the round's clients) and
# `<name>.<client>` (each client's value).
REPORT_PREFIX = "report."


def metric(metrics: Mapping[str, float], names: Sequence[str]) -> float | None:
    return next((float(metrics[n]) for n in names if metrics.get(n) is not None), None)


def sample_weighted(updates: Sequence[ClientUpdate], names: Sequence[str]) -> float:
    """Mean of a metric over the clients that report it, weighted by their samples."""
    pairs = [(u.samples, metric(u.metrics, names)) for u in updates]
    known = [(s, v) for s, v in pairs if v is not None and v == v]
    total = sum(s for s, _ in known)
    return sum(s * v for s, v in known) / total if total else NAN


def client_mean(updates: Sequence[ClientUpdate], names: Sequence[str]) -> float:
    """Plain mean over the clients that report a metric: the personalised accuracy is a mean
    over clients, as the aggregator's own evaluation takes it."""
    values = [v for u in updates if (v := metric(u.metrics, names)) is not None and v == v]
    return sum(values) / len(values) if values else NAN


def own_model_accuracy(latest: dict[str, float], updates: Sequence[ClientUpdate]) -> float:
    """Keep each reporting client's `personal_accuracy` (its model after local training, on
    its local test data) in `latest`; the mean over every client seen so far (NaN if none): a
    round's cohort may be a tenth of the clients, and the papers average over all of them."""
    for u in updates:
        value = metric(u.metrics, PERSONAL_ACCURACY)
        if value is not None and value == value:
            latest[u.client] = value
    return sum(latest.values()) / len(latest) if latest else NAN


def reported_extras(updates: Sequence[ClientUpdate]) -> dict[str, float]:
    """The `report.<name>` client metrics, per client and as their mean over clients."""
    out: dict[str, float] = {}
    values: dict[str, list[float]] = {}
    for u in sorted(updates, key=lambda u: u.client):
        for key, value in u.metrics.items():
            name = key[len(REPORT_PREFIX) :]
            if key.startswith(REPORT_PREFIX) and name:
                out[f"{name}.{u.client}"] = float(value)
                values.setdefault(name, []).append(float(value))
    for name, seen in values.items():
        finite = [v for v in seen if v == v]
        out[name] = sum(finite) / len(finite) if finite else NAN
    return out


def summed(updates: Sequence[ClientUpdate], names: Sequence[str]) -> float:
    return sum(metric(u.metrics, names) or 0.0 for u in updates)


def clients_rate(updates: Sequence[ClientUpdate], seconds: Sequence[str]) -> float | None:
    """Sum over the updates of samples trained / the `seconds` metric; None when an update
    lacks it (an older client) or reports no time."""
    times = [metric(u.metrics, seconds) for u in updates]
    if not updates or not all(t is not None and t > 0 for t in times):
        return None
    return sum(u.trained_samples / t for u, t in zip(updates, times, strict=True) if t)


def build_record(
    *,
    version: int,
    round_index: int,
    elapsed_s: float,
    updates: Sequence[ClientUpdate],
    evaluation: VersionEval | None,
    round_s: float,  # round opened (async: the last version) → last update in
    update_bytes: int = 0,  # what the aggregator measured itself
    assignment_bytes: int = 0,
    late_updates: int = 0,
    personal_from_clients: bool = False,
    strategy_metrics: Mapping[str, float] | None = None,
) -> VersionRecord:
    """`personal_from_clients`: the personalised models live on the clients only (FedDeper), so
    the personalised accuracy is the clients' reported one; the evaluation's (the global model
    on each local test set) then goes to `extra["global_personal_accuracy"]`."""
    # Samples actually trained this round; `WeightsUpdate.samples` is |D_k|, the averaging
    # weight, which max_steps_per_round may cap far below.
    samples = int(sum(u.trained_samples for u in updates))
    extra: dict[str, float] = {"round_s": round_s}
    # Sums of the clients' own rates. `client_samples_per_s` counts a client's whole round,
    # waiting for its gradients included: what the cohort trained at. The compute-only rate
    # (what it could do if the server answered at once) is not a throughput for a split
    # algorithm, and is named so.
    for name, keys in (
        ("client_samples_per_s", ROUND_WALL_S),
        ("client_compute_samples_per_s", COMPUTE_S),
    ):
        rate = clients_rate(updates, keys)
        if rate is not None:
            extra[name] = rate
    if evaluation is not None:
        extra["test_samples"] = float(evaluation.test_samples)
    # The strategy's own metrics of the version (SplitGP's `splitgp.*`), as extra columns.
    extra.update(strategy_metrics or {})
    extra.update(reported_extras(updates))
    personal = evaluation.personal_accuracy if evaluation else NAN
    if personal_from_clients:
        extra["global_personal_accuracy"] = personal
        personal = client_mean(updates, PERSONAL_ACCURACY)
    return VersionRecord(
        version=version,
        round=round_index + 1,
        elapsed_s=elapsed_s,
        participants=len(updates),
        global_accuracy=evaluation.global_accuracy if evaluation else NAN,
        global_loss=evaluation.global_loss if evaluation else NAN,
        personal_accuracy=personal,
        train_loss=sample_weighted(updates, TRAIN_LOSS),
        train_accuracy=sample_weighted(updates, TRAIN_ACCURACY),
        samples=samples,
        samples_per_s=samples / round_s if round_s > 0 else 0.0,
        bytes_up=int(summed(updates, BYTES_UP)) + update_bytes,
        bytes_down=int(summed(updates, BYTES_DOWN)) + assignment_bytes,
        late_updates=late_updates,
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
    # samples_per_s: the dashboard's per-version throughput.
    for name in (
        "global_accuracy",
        "global_loss",
        "personal_accuracy",
        "train_loss",
        "samples_per_s",
    ):
        value = float(getattr(record, name))
        if value == value:
            data[name] = value
    return data
