"""Markdown tables and numbers of an experiment's results (pure functions over a `ResultSet`)."""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

from services.experiments.results import ResultSet, RunResult, Spread
from services.experiments.spec import Table

MISSING = "–"


def percent(value: float, sign: str = "", unit: str = "") -> str:
    """An accuracy in percent as a table cell, `82.5`; with `sign="+"` a difference of two,
    in percentage points, `+1.5`; `unit` follows the number."""
    return MISSING if not math.isfinite(value) else f"{100.0 * value:{sign}.1f}{unit}"


def points(value: float) -> str:
    return percent(value, "+")


def pct(value: float) -> str:
    """An accuracy in a sentence: `82.5%`."""
    return percent(value, unit="%")


def pts(value: float) -> str:
    """A difference in a sentence: `+1.5 points`."""
    return percent(value, "+", " points")


def gap_words(gap: Spread) -> str:
    """A paired gap over seeds in a sentence: `+1.5 ± 0.4 points`, `+1.5 points, one seed`."""
    if gap.count < 2:
        return f"{pts(gap.mean)}, one seed"
    return f"{percent(gap.mean, '+')} ± {percent(gap.std)} points"


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]], caption: str = "") -> str:
    """The table, below `caption` (bold markdown) when there is one."""
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return (caption + "\n\n" if caption else "") + "\n".join(lines)


def spread_cell(spread: Spread, sign: str = "") -> str:
    """A cell over seeds: `82.5 ± 0.4` (with `sign="+"` a difference, `+1.5 ± 0.4`); one
    value alone as `percent` writes it."""
    if spread.count < 2:
        return percent(spread.mean, sign)
    return f"{percent(spread.mean, sign)} ± {percent(spread.std)}"


def render_table(table: Table, results: ResultSet) -> str:
    """Rows: every combination of the row tags' values; cells: the metric in percent, as
    mean ± std over the seeds when there are several (differences: of the means)."""
    columns = list(table.columns) or results.values(table.column)
    header = [*table.rows, *columns, *(f"{a} − {b}" for a, b in table.diffs)]
    body: list[list[str]] = []
    for combo in itertools.product(*(results.values(tag) for tag in table.rows)):
        where = dict(zip(table.rows, combo, strict=True))
        cells = {c: results.spread(table.metric, **where, **{table.column: c}) for c in columns}
        if not any(math.isfinite(v.mean) for v in cells.values()):
            continue
        row = [*combo, *(spread_cell(cells[c]) for c in columns)]
        for a, b in table.diffs:
            va = results.value(table.metric, **where, **{table.column: a})
            vb = results.value(table.metric, **where, **{table.column: b})
            row.append(points(va - vb))
        body.append(row)
    metric = table.metric.replace("_", " ")
    over = results.over_seeds("", "; ")
    return markdown_table(
        header,
        body,
        f"**{table.title}** ({metric} accuracy, %; {over}differences in points)",
    )


def runs_table(results: Sequence[RunResult]) -> str:
    """Every run: its tags, status, rounds done, final and best accuracy, wall time."""
    tags = list(dict.fromkeys(t for result in results for t in result.tags))
    seeded = len({r.seed for r in results}) > 1
    header = ["run", *tags, *(["seed"] if seeded else []), "status", "rounds", "final acc %"]
    header += ["best acc %", "wall s", "load at start"]
    rows = [
        [
            f"`{r.label}`",
            *(r.tags.get(t, "·") for t in tags),
            *([str(r.seed)] if seeded else []),
            r.status + (" (reused)" if r.reused else ""),
            f"{len(r.records)}/{r.rounds}",
            percent(r.metric("final_global")),
            percent(r.metric("best_global")),
            f"{r.wall_s:.1f}",
            MISSING if not math.isfinite(r.load) else f"{r.load:.1f}",
        ]
        for r in results
    ]
    return markdown_table(header, rows)
