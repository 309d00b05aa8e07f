"""The outcome of each run, read back from its report directory; runs of one label over several
seeds taken together; selection by tags; the few summaries of a per-round curve the
experiments' verdicts share."""

from __future__ import annotations

import itertools
import json
import math
import statistics
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Literal

from services.experiments.spec import Metric, Run
from services.report.filesink import read_records
from services.report.records import VersionRecord
from services.report.summary import Totals

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
    seed: int = 0  # the run's job.seed

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

    @property
    def settled(self) -> bool:
        """Its outcome is the settings' own: it finished, or the job failed by itself (a model
        that diverged fails the same way again), unlike a run stopped from outside."""
        return self.complete or settled_status(self.status, len(self.records), self.rounds)

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


@dataclass(frozen=True)
class Spread:
    """A summary over seeds: the mean and sample standard deviation of the finite values,
    and how many there were (std 0 for one, NaN mean for none)."""

    mean: float
    std: float
    count: int

    @classmethod
    def of(cls, values: Iterable[float]) -> Spread:
        kept = finite(values)
        if not kept:
            return cls(math.nan, math.nan, 0)
        std = statistics.stdev(kept) if len(kept) > 1 else 0.0
        return cls(statistics.fmean(kept), std, len(kept))


@dataclass(frozen=True)
class SeedRuns:
    """The runs of one label, one per seed, read as one result: summaries and curves are the
    means over the seeds (`spread` and `band` give their spread), so a verdict or a table
    written for one seed reads the mean of several unchanged. With one seed it is that run."""

    runs: tuple[RunResult, ...]

    def __post_init__(self) -> None:
        if not self.runs:
            raise ValueError("SeedRuns of no run")

    @property
    def first(self) -> RunResult:
        return self.runs[0]

    @property
    def run(self) -> Run:
        return self.first.run

    @property
    def label(self) -> str:
        return self.first.label

    @property
    def tags(self) -> Mapping[str, str]:
        return self.first.tags

    @property
    def algorithm(self) -> str:
        return self.first.algorithm

    @property
    def run_dir(self) -> Path:
        return self.first.run_dir

    @property
    def rounds(self) -> int:
        return self.first.rounds

    @property
    def seeds(self) -> tuple[int, ...]:
        return tuple(r.seed for r in self.runs)

    @property
    def status(self) -> str:
        """ "finished" when every seed finished, else the first seed's that did not."""
        return next((r.status for r in self.runs if r.status != "finished"), "finished")

    @property
    def complete(self) -> bool:
        return all(r.complete for r in self.runs)

    @property
    def wall_s(self) -> float:
        return sum(r.wall_s for r in self.runs)

    @property
    def records(self) -> tuple[VersionRecord, ...]:
        """Per round, the seeds' records averaged (as long as the shortest seed's)."""
        if len(self.runs) == 1:
            return self.first.records
        return tuple(
            mean_record(rows) for rows in zip(*(r.records for r in self.runs), strict=False)
        )

    @property
    def final(self) -> Mapping[str, float]:
        keys = dict.fromkeys(k for r in self.runs for k in r.final)
        return {k: mean(r.final.get(k, math.nan) for r in self.runs) for k in keys}

    def metric(self, name: Metric) -> float:
        return self.spread(name).mean

    def spread(self, name: Metric) -> Spread:
        return Spread.of(r.metric(name) for r in self.runs)

    def curve(self, name: str = "global_accuracy") -> list[float]:
        return [b.mean for b in self.band(name)]

    def band(self, name: str = "global_accuracy") -> list[Spread]:
        """Per round, the spread of a curve over the seeds (as long as the shortest seed's)."""
        return [
            Spread.of(values) for values in zip(*(r.curve(name) for r in self.runs), strict=False)
        ]

    def pair(self, prefix: str) -> tuple[float, float]:
        pairs = [r.pair(prefix) for r in self.runs]
        return mean(p[0] for p in pairs), mean(p[1] for p in pairs)


def settled_status(status: str, records: int, rounds: int) -> bool:
    """A run's status and record count say it is done with: finished all its rounds, or
    failed by itself (`RunResult.settled`)."""
    return (status == "finished" and records >= rounds) or status.startswith("failed")


# A gap over seeds no larger than this many of its standard deviations is read as no gap.
SPREAD_FACTOR = 2.0


def paired_gap(
    ours: SeedRuns,
    theirs: SeedRuns,
    value: Callable[[SeedRuns], float],
    their_value: Callable[[SeedRuns], float] | None = None,
) -> Spread:
    """`value(ours) - their_value(theirs)` (`value` for both by default), seed by seed over the
    seeds both ran: each seed's run read alone, so that what one seed's partition and initial
    model do to both cancels."""
    other = value if their_value is None else their_value
    seeds = range(min(len(ours.runs), len(theirs.runs)))
    return Spread.of(
        value(SeedRuns((ours.runs[i],))) - other(SeedRuns((theirs.runs[i],))) for i in seeds
    )


def within_spread(gap: Spread) -> bool:
    """The gap is no larger than `SPREAD_FACTOR` standard deviations over its seeds (never
    with one seed: there is no spread to judge it by)."""
    return gap.count > 1 and abs(gap.mean) <= SPREAD_FACTOR * gap.std


def ahead_words(gap: Spread, yes: str, no: str, tie: str) -> str:
    """The verdict words of a paired gap over seeds: `tie` within seed spread, else `yes`
    when ahead and `no` when not."""
    if within_spread(gap):
        return tie
    return yes if gap.mean > 0 else no


def mean_record(rows: Sequence[VersionRecord]) -> VersionRecord:
    """One round's records of several seeds as one: numbers averaged (counts rounded), the
    version and round of the first, each `extra` metric averaged over the seeds having it."""
    first = rows[0]
    values: dict[str, Any] = {}
    for f in fields(VersionRecord):
        if f.name in ("version", "round", "extra"):
            continue
        average = mean(float(getattr(r, f.name)) for r in rows)
        values[f.name] = round(average) if isinstance(getattr(first, f.name), int) else average
    keys = dict.fromkeys(k for r in rows for k in r.extra)
    extra = {k: mean(r.extra.get(k, math.nan) for r in rows) for k in keys}
    return VersionRecord(version=first.version, round=first.round, extra=extra, **values)


def load_result(run: Run, run_dir: Path, *, reused: bool = False, seed: int = 0) -> RunResult:
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
        records=tuple(records),
        reused=reused,
        machine=str(meta.get("machine", "")),
        load=math.nan if meta.get("load") is None else float(meta["load"]),
        final={str(k): float(v) for k, v in doc.items()},
        seed=seed,
    )


def matches(tags: Mapping[str, str], where: Mapping[str, str]) -> bool:
    """Whether a run with `tags` fits `where`; a tag the run lacks fits any value."""
    return all(tags.get(key, value) == value for key, value in where.items())


class ResultSet:
    """All results of one experiment invocation, looked up by tags: `runs` every run (one per
    label and seed), `results` the labels with their seeds taken together, in declared order."""

    def __init__(self, runs: Sequence[RunResult]) -> None:
        self.runs = tuple(runs)
        labels: dict[str, list[RunResult]] = {}
        for run in self.runs:
            labels.setdefault(run.label, []).append(run)
        self.results = tuple(SeedRuns(tuple(group)) for group in labels.values())

    def __iter__(self) -> Iterator[SeedRuns]:
        return iter(self.results)

    def __len__(self) -> int:
        return len(self.results)

    @property
    def seeds(self) -> int:
        """Seeds per label (the most any label has; 0 without runs)."""
        return max((len(r.runs) for r in self.results), default=0)

    def over_seeds(self, before: str = "; ", after: str = "") -> str:
        """A caption's note that its numbers are means over the seeds ("" for one seed)."""
        return f"{before}mean ± std over {self.seeds} seeds{after}" if self.seeds > 1 else ""

    def one(self, where: Mapping[str, str]) -> SeedRuns | None:
        """The single run that fits `where` best: the one that names the most of its tags.

        A baseline without a `cut` tag fits `cut=block2`, but so may a run tagged
        `cut=block2`; the one that names the cut is the better match.
        """
        found = [r for r in self.results if matches(r.tags, where)]
        return max(found, key=lambda r: sum(k in r.tags for k in where)) if found else None

    def named(
        self, need: Literal["records", "final", ""] = "records", **where: str
    ) -> SeedRuns | None:
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
        return self.spread(metric, **where).mean

    def spread(self, metric: Metric, **where: str) -> Spread:
        """`metric` over the seeds of the run fitting `where` (no values when there is none)."""
        result = self.one(where)
        return result.spread(metric) if result is not None else Spread.of(())

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
