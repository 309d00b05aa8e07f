"""The outcome of each run, read back from its report directory; selection by tags; the few
summaries of a per-round curve the experiments' verdicts share."""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from services.experiments.spec import Metric, Run
from services.report.records import VersionRecord
from services.report.rundir import METRICS_JSON
from services.report.summary import Totals
from services.report.tables import record_from_dict

# Written by the experiment runner beside metrics.json: what the report directory lacks.
EXPERIMENT_JSON = "experiment.json"
# The experiment's `final_eval` of the run's last version, where it has one.
FINAL_JSON = "final.json"


@dataclass(frozen=True)
class RunResult:
    run: Run
    run_dir: Path
    status: str  # "finished", "stopped", "failed: ..."
    wall_s: float
    rounds: int  # rounds the config asked for
    records: tuple[VersionRecord, ...]
    reused: bool = False  # taken from an earlier invocation (--reuse)
    machine: str = ""  # `runner.machine_line()` where it ran
    load: float = math.nan  # 1-minute load average when it started
    final: Mapping[str, float] = field(default_factory=dict)  # `Experiment.final_eval`'s

    @property
    def label(self) -> str:
        return self.run.label

    @property
    def tags(self) -> Mapping[str, str]:
        return self.run.tags

    @property
    def algorithm(self) -> str:
        """The algorithm the run's overrides name ("" when it runs the base config's)."""
        return str(self.run.overrides.get("algorithm", {}).get("name", ""))

    @property
    def complete(self) -> bool:
        return self.status == "finished" and len(self.records) >= self.rounds

    def metric(self, name: Metric) -> float:
        totals = Totals.of(self.records)
        return math.nan if totals is None else float(getattr(totals, name))

    def curve(self, name: str = "global_accuracy") -> list[float]:
        """A `VersionRecord` field per round, or an `extra` (NaN where a round lacks it)."""
        if name in VersionRecord.__dataclass_fields__:
            return [float(getattr(r, name)) for r in self.records]
        return [r.extra.get(name, math.nan) for r in self.records]

    def pair(self, prefix: str) -> tuple[float, float]:
        """The final evaluation's (`<prefix>_local`, `<prefix>_ood`), NaN where absent."""
        local, ood = (self.final.get(f"{prefix}_{part}", math.nan) for part in ("local", "ood"))
        return local, ood


def read_records(run_dir: Path) -> tuple[dict[str, Any], tuple[VersionRecord, ...]]:
    """The run info and the records of a report directory's metrics.json."""
    doc = json.loads((run_dir / METRICS_JSON).read_text(encoding="utf-8"))
    records = tuple(record_from_dict(r) for r in doc.get("records", []))
    return dict(doc.get("run", {})), records


def load_result(run: Run, run_dir: Path, *, reused: bool = False) -> RunResult:
    """The run's records from metrics.json, its wall time and host from experiment.json and
    its final evaluation from final.json (none when the experiment has no `final_eval`)."""
    info, records = read_records(run_dir)
    meta = json.loads((run_dir / EXPERIMENT_JSON).read_text(encoding="utf-8"))
    final = run_dir / FINAL_JSON
    doc = json.loads(final.read_text(encoding="utf-8")) if final.exists() else {}
    return RunResult(
        run=run,
        run_dir=run_dir,
        status=str(info.get("status", "unknown")),
        wall_s=float(meta["wall_s"]),
        rounds=int(info.get("rounds", 0)),
        records=records,
        reused=reused,
        machine=str(meta.get("machine", "")),
        load=math.nan if meta.get("load") is None else float(meta["load"]),
        final={str(k): float(v) for k, v in doc.items()},
    )


def matches(tags: Mapping[str, str], where: Mapping[str, str]) -> bool:
    """Whether a run with `tags` fits `where`; a tag the run lacks fits any value."""
    return all(tags.get(key, value) == value for key, value in where.items())


class ResultSet:
    """All results of one experiment invocation, looked up by tags."""

    def __init__(self, results: Sequence[RunResult]) -> None:
        self.results = tuple(results)

    def __iter__(self) -> Iterator[RunResult]:
        return iter(self.results)

    def __len__(self) -> int:
        return len(self.results)

    def one(self, where: Mapping[str, str]) -> RunResult | None:
        """The single run that fits `where` best: the one that names the most of its tags.

        A baseline without a `cut` tag fits `cut=block2`, but so may a run tagged
        `cut=block2`; the one that names the cut is the better match.
        """
        found = [r for r in self.results if matches(r.tags, where)]
        return max(found, key=lambda r: sum(k in r.tags for k in where)) if found else None

    def named(
        self, need: Literal["records", "final", ""] = "records", **where: str
    ) -> RunResult | None:
        """The run tagged with exactly `where` (no baseline standing in for it) that has
        `records` (or its `final` evaluation, `need="final"`; anything, `need=""`); None
        otherwise."""
        found = self.one(where)
        if found is None or any(found.tags.get(k) != v for k, v in where.items()):
            return None
        has = {"records": bool(found.records), "final": bool(found.final), "": True}
        return found if has[need] else None

    def value(self, metric: Metric, **where: str) -> float:
        """`metric` of the run fitting `where`, NaN when there is none."""
        result = self.one(where)
        return result.metric(metric) if result is not None else math.nan

    def values(self, tag: str) -> list[str]:
        """The values `tag` takes among the runs, in the order the runs were declared."""
        return list(dict.fromkeys(r.tags[tag] for r in self.results if tag in r.tags))


def finite(values: Iterable[float]) -> list[float]:
    return [v for v in values if math.isfinite(v)]


def mean(values: Iterable[float]) -> float:
    """The mean of the finite values, NaN when there is none."""
    kept = finite(values)
    return sum(kept) / len(kept) if kept else math.nan


def late_mean(curve: Sequence[float], rounds: int) -> float:
    """The mean of the last `rounds` values of a per-round curve: under label-skewed sampling
    a single round's value swings by points from one round to the next."""
    return mean(curve[-rounds:])


def swing(curve: Sequence[float]) -> float:
    """Mean absolute change between consecutive rounds of a per-round curve."""
    return mean(abs(b - a) for a, b in itertools.pairwise(finite(curve)))
