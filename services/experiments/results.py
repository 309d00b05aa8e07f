"""The outcome of each run, read back from its report directory, and selection by tags."""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

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
    machine: str = ""  # `host.machine_line()` where it ran
    load: float = math.nan  # 1-minute load average when it started
    final: Mapping[str, float] = field(default_factory=dict)  # `Experiment.final_eval`'s

    @property
    def label(self) -> str:
        return self.run.label

    @property
    def tags(self) -> Mapping[str, str]:
        return self.run.tags

    @property
    def complete(self) -> bool:
        return self.status == "finished" and len(self.records) >= self.rounds

    def metric(self, name: Metric) -> float:
        totals = Totals.of(self.records)
        if totals is None:
            return math.nan
        value: float = getattr(totals, name)
        return value


def read_records(run_dir: Path) -> tuple[dict[str, Any], tuple[VersionRecord, ...]]:
    """The run info and the records of a report directory's metrics.json."""
    doc = json.loads((run_dir / METRICS_JSON).read_text(encoding="utf-8"))
    records = tuple(record_from_dict(r) for r in doc.get("records", []))
    return dict(doc.get("run", {})), records


def read_final(run_dir: Path) -> dict[str, float]:
    """The run's `final.json` (its last version's final evaluation); {} when it has none."""
    try:
        doc = json.loads((run_dir / FINAL_JSON).read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    return {str(k): float(v) for k, v in doc.items()}


def load_result(run: Run, run_dir: Path, *, reused: bool = False) -> RunResult:
    """The run's records from metrics.json and its wall time and host from experiment.json."""
    info, records = read_records(run_dir)
    meta = json.loads((run_dir / EXPERIMENT_JSON).read_text(encoding="utf-8"))
    load = meta.get("load")
    return RunResult(
        run=run,
        run_dir=run_dir,
        status=str(info.get("status", "unknown")),
        wall_s=float(meta["wall_s"]),
        rounds=int(info.get("rounds", 0)),
        records=records,
        reused=reused,
        machine=str(meta.get("machine", "")),
        load=float(load) if load is not None else math.nan,
        final=read_final(run_dir),
    )


def matches(tags: Mapping[str, str], where: Mapping[str, str]) -> bool:
    """Whether a run with `tags` fits `where`; a tag the run lacks fits any value."""
    return all(tags.get(key, value) == value for key, value in where.items())


def tag_values(results: Iterable[RunResult], tag: str) -> list[str]:
    """The values `tag` takes among `results`, in the order the runs were declared."""
    seen: list[str] = []
    for result in results:
        value = result.tags.get(tag)
        if value is not None and value not in seen:
            seen.append(value)
    return seen


class ResultSet:
    """All results of one experiment invocation, looked up by tags."""

    def __init__(self, results: Sequence[RunResult]) -> None:
        self.results = tuple(results)

    def __iter__(self) -> Iterator[RunResult]:
        return iter(self.results)

    def __len__(self) -> int:
        return len(self.results)

    def select(self, where: Mapping[str, str]) -> list[RunResult]:
        return [r for r in self.results if matches(r.tags, where)]

    def one(self, where: Mapping[str, str]) -> RunResult | None:
        """The single run that fits `where` best: the one that names the most of its tags.

        A baseline without a `cut` tag fits `cut=block2`, but so may a run tagged
        `cut=block2`; the one that names the cut is the better match.
        """
        found = self.select(where)
        if not found:
            return None
        return max(found, key=lambda r: sum(1 for k in where if k in r.tags))

    def value(self, metric: Metric, **where: str) -> float:
        """`metric` of the run fitting `where`, NaN when there is none."""
        result = self.one(where)
        return result.metric(metric) if result is not None else math.nan

    @property
    def runs(self) -> list[Run]:
        return [r.run for r in self.results]

    def values(self, tag: str) -> list[str]:
        return tag_values(self.results, tag)
