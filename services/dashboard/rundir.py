"""The run directory as the dashboard reads it: metrics.json (records, status), summary.txt."""

from __future__ import annotations

import json
import re
from pathlib import Path

from services.dashboard.state import RunReport
from services.report.rundir import METRICS_JSON, SUMMARY_FILE


def find_run_dir(report_dir: Path, job: str, since: float) -> Path | None:
    """The newest `<job>-<date>-<time>` run directory whose metrics.json changed after `since`
    (a wall-clock time): the run in progress, not an old one of the same job name."""
    pattern = re.compile(re.escape(job) + r"-\d{8}-\d{6}(-\d+)?")
    best: tuple[float, Path] | None = None
    try:
        candidates = list(report_dir.iterdir())
    except OSError:
        return None
    for path in candidates:
        if not pattern.fullmatch(path.name):
            continue
        try:
            mtime = (path / METRICS_JSON).stat().st_mtime
        except OSError:
            continue
        if mtime >= since and (best is None or mtime > best[0]):
            best = (mtime, path)
    return best[1] if best else None


def read_report(run_dir: Path) -> RunReport | None:
    """None while metrics.json is missing or unreadable (it is replaced atomically, so a read
    never sees half a file)."""
    try:
        doc = json.loads((run_dir / METRICS_JSON).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(doc, dict):
        return None
    run = doc.get("run")
    if not isinstance(run, dict):
        run = {}
    records = [r for r in doc.get("records", []) if isinstance(r, dict)]
    try:
        summary = (run_dir / SUMMARY_FILE).read_text(encoding="utf-8")
    except OSError:
        summary = ""
    return RunReport(str(run_dir), str(run.get("status", "")), records, summary)
