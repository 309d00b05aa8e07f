"""`FileSink`: a MetricsSink that keeps the run directory current as records arrive.

metrics.json and metrics.csv are rewritten atomically on every record, so a run that crashes
or is killed still leaves every version it published on disk. `finish` adds the end time and
status, the plots and summary.txt. `FileSink.resume` goes on with the records of a stopped run
(`splitmq run|up --resume`, services/report/resume.py).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, replace
from datetime import datetime
from pathlib import Path
from typing import Any

from services.algorithms.registry import REGISTRY
from services.config.root import Settings
from services.report.plots import DEFAULT_PLOTS, PlotSpec, write_plots
from services.report.records import VersionRecord
from services.report.rundir import (
    METRICS_CSV,
    METRICS_JSON,
    SUMMARY_FILE,
    RunInfo,
    create_run_dir,
    write_atomic,
    write_config,
)
from services.report.summary import summary_text
from services.report.tables import metrics_csv, metrics_json, record_from_dict

_log = logging.getLogger("splitmq.report")


def write_records(run_dir: Path, run: Mapping[str, Any], records: Sequence[VersionRecord]) -> None:
    """metrics.json and metrics.csv of `records`, each replaced in one step."""
    write_atomic(run_dir / METRICS_JSON, metrics_json(run, records))
    write_atomic(run_dir / METRICS_CSV, metrics_csv(records))


def read_records(run_dir: Path) -> tuple[dict[str, Any], list[VersionRecord]]:
    """metrics.json's run info and records, as `write_records` wrote them."""
    doc = json.loads((run_dir / METRICS_JSON).read_text(encoding="utf-8"))
    return dict(doc["run"]), [record_from_dict(r) for r in doc["records"]]


def plot_spec(settings: Settings) -> PlotSpec | None:
    """The plots a run of `settings` draws (None: none)."""
    report = settings.report
    own = REGISTRY.get(settings.algorithm.name).strategy.traits.report_plots
    return PlotSpec(report.plot_formats, own) if report.plots else None


class FileSink:
    def __init__(
        self,
        run_dir: Path,
        info: RunInfo,
        *,
        plots: PlotSpec | None = DEFAULT_PLOTS,
        records: Sequence[VersionRecord] = (),
    ) -> None:
        """`plots`: None for no plots; `records`: those of the run so far (a resumed one's);
        its wall time goes on from the last one's `elapsed_s`."""
        self.run_dir = run_dir
        self._info = info
        self._plots = plots
        self.elapsed_before_s = records[-1].elapsed_s if records else 0.0
        self._started = time.monotonic() - self.elapsed_before_s
        self._lock = threading.Lock()
        self._records: list[VersionRecord] = list(records)
        self._summary = ""
        self._finished = False
        self._write_metrics()

    @classmethod
    def create(
        cls,
        settings: Settings,
        *,
        command: str,
        base_dir: Path | None = None,
        run_dir: Path | None = None,
    ) -> FileSink:
        """A fresh run directory under `base_dir` (default `report.dir`), or exactly `run_dir`."""
        started = datetime.now()
        if run_dir is None:
            base = base_dir or Path(settings.report.dir)
            run_dir = create_run_dir(base, settings.job.name, started)
        else:
            run_dir.mkdir(parents=True, exist_ok=True)
        write_config(run_dir, settings)
        info = RunInfo.for_settings(settings, command, started)
        return cls(run_dir, info, plots=plot_spec(settings))

    @classmethod
    def resume(cls, settings: Settings, run_dir: Path, *, command: str) -> FileSink:
        """Go on with the run in `run_dir` (its metrics as `resume.prepare_resume` left them):
        the records kept, the run marked running again, the settings as now (config.toml
        rewritten: a resume may train more rounds)."""
        write_config(run_dir, settings)
        stored, records = read_records(run_dir)
        run = RunInfo(**stored)
        now = datetime.now().astimezone().isoformat(timespec="seconds")
        resumed = ",".join(filter(None, (run.extra.get("resumed_at", ""), now)))
        info = replace(
            run,
            status="running",
            ended_at="",
            rounds=settings.job.rounds,
            extra={**run.extra, "resumed_at": resumed, "resumed_by": command},
        )
        return cls(run_dir, info, plots=plot_spec(settings), records=records)

    @property
    def info(self) -> RunInfo:
        return self._info

    @property
    def records(self) -> list[VersionRecord]:
        with self._lock:
            return list(self._records)

    @property
    def summary(self) -> str:
        """summary.txt's text once finished, else ""."""
        return self._summary

    def record(self, record: VersionRecord) -> None:
        with self._lock:
            self._records.append(record)
            self._write_metrics()

    def finish(self, status: str) -> None:
        """Close the report; only the first call counts (the job's own status wins)."""
        with self._lock:
            if self._finished:
                return
            self._finished = True
            self._info = self._info.ended(status, datetime.now())
            self._write_metrics()
            if self._plots is not None:
                try:
                    write_plots(
                        self.run_dir,
                        self._records,
                        formats=self._plots.formats,
                        algorithm_plots=self._plots.algorithm,
                    )
                except (OSError, ValueError, RuntimeError) as exc:
                    # The metrics are the record of the run; a plot failure must not lose them.
                    _log.warning("could not write plots to %s: %s", self.run_dir, exc)
            wall_s = time.monotonic() - self._started
            self._summary = summary_text(self._info, self._records, self.run_dir, wall_s)
            write_atomic(self.run_dir / SUMMARY_FILE, self._summary)

    def _write_metrics(self) -> None:
        write_records(self.run_dir, asdict(self._info), self._records)
