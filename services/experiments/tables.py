"""Markdown tables of an experiment's results (pure functions over a `ResultSet`)."""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

from services.experiments.results import ResultSet, RunResult
from services.experiments.spec import Table

MISSING = "–"


def percent(value: float) -> str:
    return MISSING if not math.isfinite(value) else f"{100.0 * value:.1f}"


def points(value: float) -> str:
    """A difference of two accuracies, in percentage points with its sign."""
    return MISSING if not math.isfinite(value) else f"{100.0 * value:+.1f}"


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = [
        "| " + " | ".join(header) + " |",
        "|" + "|".join("---" for _ in header) + "|",
    ]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def render_table(table: Table, results: ResultSet) -> str:
    """Rows: every combination of the row tags' values; cells: the metric in percent."""
    columns = list(table.columns) or results.values(table.column)
    row_values = [results.values(tag) for tag in table.rows]
    header = [*table.rows, *columns, *(f"{a} − {b}" for a, b in table.diffs)]
    body: list[list[str]] = []
    for combo in itertools.product(*row_values):
        where = dict(zip(table.rows, combo, strict=True))
        cells = {c: results.value(table.metric, **where, **{table.column: c}) for c in columns}
        if not any(math.isfinite(v) for v in cells.values()):
            continue
        row = [*combo, *(percent(cells[c]) for c in columns)]
        for a, b in table.diffs:
            va = results.value(table.metric, **where, **{table.column: a})
            vb = results.value(table.metric, **where, **{table.column: b})
            row.append(points(va - vb))
        body.append(row)
    metric = table.metric.replace("_", " ")
    caption = f"**{table.title}** ({metric} accuracy, %; differences in points)"
    return caption + "\n\n" + markdown_table(header, body)


def runs_table(results: Sequence[RunResult]) -> str:
    """Every run: its tags, status, rounds done, final and best accuracy, wall time."""
    tags: list[str] = []
    for result in results:
        tags += [t for t in result.tags if t not in tags]
    header = [
        "run",
        *tags,
        "status",
        "rounds",
        "final acc %",
        "best acc %",
        "wall s",
        "load at start",
    ]
    rows = []
    for r in results:
        status = r.status + (" (reused)" if r.reused else "")
        rows.append(
            [
                f"`{r.label}`",
                *(r.tags.get(t, "·") for t in tags),
                status,
                f"{len(r.records)}/{r.rounds}",
                percent(r.metric("final_global")),
                percent(r.metric("best_global")),
                f"{r.wall_s:.1f}",
                MISSING if not math.isfinite(r.load) else f"{r.load:.1f}",
            ]
        )
    return markdown_table(header, rows)
